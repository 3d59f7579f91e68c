"""`kvreuse simulate [GEOMETRY.toml] WORKLOAD.jsonl --out DIR`.

Prints a summary table (or `--json`) and writes requests.jsonl, summary.json, report.md and the
plots (`--no-plots` to skip them) to DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvreuse.core import ConfigError
from kvreuse.deployment import PRESETS, GeometryError, preset, resolve
from kvreuse.sim.run import CostModel, SimResult, simulate, without_deferral
from kvreuse.sim.workload import WorkloadError, load_workload

DEFAULT_COST = CostModel()


def add_parser(sub: Any) -> None:
    p = sub.add_parser("simulate", help="replay a workload on a cache geometry")
    p.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="GEOMETRY.toml WORKLOAD.jsonl, or WORKLOAD.jsonl with --geometry",
    )
    p.add_argument(
        "--geometry",
        dest="preset",
        choices=sorted(PRESETS),
        help="a preset instead of a geometry file",
    )
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--no-compare",
        action="store_true",
        help="when requests waited for a shared prefix, skip the second run without deferral",
    )
    p.add_argument("--prefill-tokens-per-s", type=float, default=DEFAULT_COST.prefill_tokens_per_s)
    p.add_argument("--decode-step-s", type=float, default=DEFAULT_COST.decode_step_s)
    p.add_argument(
        "--draft-accept-rate",
        type=float,
        default=0.7,
        help="with num_spec_tokens > 0: probability that each draft token is accepted",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        if args.preset:
            if len(args.files) != 1:
                raise GeometryError("with --geometry, give only the workload file")
            geo, wl_path = preset(args.preset), Path(args.files[0])
        else:
            if len(args.files) != 2:
                raise GeometryError("give GEOMETRY.toml and WORKLOAD.jsonl (or --geometry NAME)")
            geo, wl_path = resolve(Path(args.files[0])), Path(args.files[1])
        workload = load_workload(wl_path.read_text().splitlines())
        cost = CostModel(args.prefill_tokens_per_s, args.decode_step_s)
        show = not args.quiet and sys.stderr.isatty()
        on_step, close = _progress_bar(len(workload)) if show else (None, None)
        rate = args.draft_accept_rate
        result = simulate(geo, workload, cost, on_step, rate)
        if close:
            close()
        if result.summary["deferral_waits"] and not args.no_compare:
            result.summary["without_deferral"] = without_deferral(geo, workload, cost, rate)
    except (GeometryError, WorkloadError, ConfigError, OSError, ValueError) as exc:
        print(f"kvreuse simulate: {exc}", file=sys.stderr)
        return 2
    write_outputs(args.out, geo.name, result)
    if not args.no_plots:
        from kvreuse.sim.plots import write_plots

        write_plots(args.out, geo.name, result)
    if args.json:
        print(json.dumps(result.summary, indent=2))
    else:
        print(summary_table(geo.name, result, args.out))
    if not result.summary["reconciled"]:
        failed = [k for k, ok in result.summary["reconciliation"].items() if not ok]
        print(f"kvreuse simulate: reconciliation failed: {failed}", file=sys.stderr)
        return 1
    return 0


def _progress_bar(total: int) -> tuple[Callable[[int, int], None], Callable[[], None]]:
    """A tqdm bar on stderr: the `on_step(done, total)` callback that moves it, and its close."""
    from tqdm import tqdm

    bar = tqdm(total=total, unit="req", desc="simulating", file=sys.stderr)

    def update_to(done: int, _total: int) -> None:
        bar.update(done - bar.n)

    return update_to, bar.close


def summary_table(name: str, result: SimResult, out: Path) -> str:
    """A readable table for the terminal: per request kind, then the totals."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in result.requests:
        groups.setdefault(r["id"].rsplit("-", 1)[0] if "-" in r["id"] else r["id"], []).append(r)
    width = max(12, *(len(k) for k in groups))
    lines = [
        f"{'requests':<{width}} {'n':>5} {'prompt tok':>11} {'cached tok':>11} "
        f"{'reuse':>6} {'TTFT est (s)':>13}"
    ]
    for key, rows in groups.items():
        prompt = sum(r["prompt_tokens"] for r in rows)
        cached = sum(r["cached_tokens"] for r in rows)
        ttft = sum(r["ttft_estimate_s"] for r in rows) / len(rows)
        lines.append(
            f"{key:<{width}} {len(rows):>5} {prompt:>11,} {cached:>11,} "
            f"{cached / prompt if prompt else 0:>6.1%} {ttft:>13.4f}"
        )
    s = result.summary
    lines += [
        "",
        f"{name}: {s['requests']} requests, {s['hits']:,} of {s['queries']:,} prompt tokens "
        f"reused ({s['hit_rate']:.1%}); {s['preemptions']} preemptions, "
        f"{s['evicted_blocks']} evicted blocks, peak usage {s['peak_usage']:.1%}",
        f"reconciliation {'passed' if s['reconciled'] else 'FAILED'}; outputs in {out}/",
    ]
    off = s.get("without_deferral")
    if off:
        lines.insert(
            -1,
            f"in-batch sharing: {s['prefill_tokens_computed']:,} prefill tokens computed with "
            f"deferral, {off['prefill_tokens_computed']:,} without",
        )
    return "\n".join(lines)


def write_outputs(out: Path, name: str, result: SimResult) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / "requests.jsonl").open("w") as f:
        for row in result.requests:
            f.write(json.dumps(row) + "\n")
    (out / "summary.json").write_text(json.dumps(result.summary, indent=2) + "\n")
    s = result.summary
    lines = [
        f"# Simulation report: {name}",
        "",
        "![cached vs prompt tokens](cached_vs_prompt.png)",
        "![pool usage and hit rate](usage_hit_rate.png)",
        "",
        f"- requests: {s['requests']}, prompt tokens (queries): {s['queries']:,}, "
        f"reused (hits): {s['hits']:,}, hit rate {s['hit_rate']:.1%}",
        f"- preemptions: {s['preemptions']}, evicted blocks: {s['evicted_blocks']}, "
        f"peak usage {s['peak_usage']:.1%}, capacity {s['capacity_tokens']:,} tokens",
        f"- simulated time {s['simulated_seconds']:.3f} s over {s['steps']} steps "
        "(cost model estimate, not a measurement)",
        f"- reconciliation: {'passed' if s['reconciled'] else 'FAILED'} {s['reconciliation']}",
        *_deferral_section(s),
        "",
        "| id | prompt | cached | reason | preemptions | TTFT estimate (s) |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['id']} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['reason']} | "
        f"{r['preemptions']} | {r['ttft_estimate_s']:.4f} |"
        for r in result.requests
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _deferral_section(s: dict[str, Any]) -> list[str]:
    """In-batch sharing: prefill computed with deferral vs a second run without it."""
    lines = [
        "",
        "## In-batch prefix sharing",
        "",
        f"Requests waited {s['deferral_waits']} request-steps for a prefix another request was "
        f"computing; {s['prefill_tokens_computed']:,} prefill tokens were computed.",
    ]
    off = s.get("without_deferral")
    if off:
        saved = off["prefill_tokens_computed"] - s["prefill_tokens_computed"]
        lines += [
            "",
            "| run | prefill tokens computed | reused tokens | simulated s |",
            "|---|---|---|---|",
            f"| with deferral | {s['prefill_tokens_computed']:,} | {s['hits']:,} | "
            f"{s['simulated_seconds']:.3f} |",
            f"| without deferral | {off['prefill_tokens_computed']:,} | {off['hits']:,} | "
            f"{off['simulated_seconds']:.3f} |",
            "",
            f"Deferral saved {saved:,} prefill tokens.",
        ]
    return lines
