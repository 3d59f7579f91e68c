"""What `kvreuse simulate` shows: the terminal table and report.md (summary.json is the summary
as is). Both read the run's `Tally`, never every row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvreuse.sim.run import SimResult
from kvreuse.sim.tally import REPORT_ROWS, KindTotals, Tally
from kvreuse.vocab import percent, plural

PLOTS = (
    ("cached_vs_prompt.png", "cached vs prompt tokens"),
    ("usage_hit_rate.png", "pool usage and hit rate"),
)


def _seconds(total: float, kind: KindTotals) -> str:
    return f"{total / kind.num_timed:.4f}" if kind.num_timed else "—"


def kinds_table(result: SimResult) -> list[str]:
    """One row per request kind: counts, reuse, and the two time estimates. Prompt tokens and
    reuse count the admitted requests, as the totals' hit rate does; `refused` the others."""
    kinds = result.tally.kinds
    width = max(12, *(len(k) for k in kinds)) if kinds else 12
    refused = any(k.num_refused for k in kinds.values())
    lines = [
        f"{'requests':<{width}} {'n':>7} "
        + (f"{'refused':>7} " if refused else "")
        + f"{'prompt tok':>12} {'cached tok':>12} {'reuse':>7} {'queue (s)':>10} {'TTFT (s)':>9}"
    ]
    for key, k in kinds.items():
        lines.append(
            f"{key:<{width}} {k.num_requests:>7,} "
            + (f"{k.num_refused:>7,} " if refused else "")
            + f"{k.prompt_tokens:>12,} {k.cached_tokens:>12,} "
            f"{percent(k.cached_tokens, k.prompt_tokens):>7} {_seconds(k.queue_s, k):>10} "
            f"{_seconds(k.ttft_s, k):>9}"
        )
    return lines


def summary_table(name: str, result: SimResult, out: Path) -> str:
    """A readable table for the terminal: per request kind, then the totals."""
    s = result.summary
    lines = [
        *kinds_table(result),
        "(prompt tok and reuse: admitted requests; means of cost-model estimates: queue = "
        "arrival → first step; TTFT = arrival → first token)",
        "",
        f"{name}: {plural(s['requests'], 'request')}; {result.tally.hit_rate_line()}",
        f"{plural(s['preemptions'], 'preemption')}, {plural(s['evicted_blocks'], 'evicted block')}"
        f", peak usage {percent(s['peak_usage'], 1)}",
    ]
    lines += tier_lines(s)
    off = s.get("without_deferral")
    if off:
        lines.append(
            f"in-batch sharing: {s['prefill_tokens_computed']:,} prefill tokens computed with "
            f"deferral, {off['prefill_tokens_computed']:,} without" + _deferral_cost(s, off)
        )
    too_large = result.tally.too_large_line(s["capacity_tokens"])
    if too_large:
        lines.append(too_large)
    lines.append(f"reconciliation {'passed' if s['reconciled'] else 'FAILED'}; outputs in {out}/")
    return "\n".join(lines)


def tier_lines(s: dict[str, Any]) -> list[str]:
    """One line per memory tier below the pool: the hit tokens it gave back and their loads."""
    out = []
    for name, t in s.get("tiers", {}).items():
        if isinstance(t, dict):
            blocks = plural(t["loaded_blocks"], "block")
            out.append(
                f"{name} tier: {t['hit_tokens']:,} hit tokens loaded ({blocks}, "
                f"{t['load_seconds']:.3f} s of loads); holds {t['held_blocks']:,} of "
                f"{t['capacity_blocks']:,} blocks"
            )
    return out


def _deferral_cost(s: dict[str, Any], off: dict[str, Any]) -> str:
    """Why deferral computed more prefill than the run without it, when it did: deferring
    changes which requests run together, and under pressure the two runs then evict and
    preempt differently (a preempted request computes its prompt again)."""
    more = s["prefill_tokens_computed"] - off["prefill_tokens_computed"]
    if more <= 0:
        return ""
    return (
        f" ({more:,} more with deferral: the runs scheduled differently, and "
        f"evicted {s['evicted_blocks']:,} and {off.get('evicted_blocks', 0):,} blocks and "
        f"preempted {s['preemptions']:,} and {off.get('preemptions', 0):,} times)"
    )


def write_report(out: Path, name: str, result: SimResult, plots: bool) -> None:
    """report.md: the summary, the table per kind, and the first requests (`plots`: link the
    PNGs, which exist only when they were written)."""
    s = result.summary
    interrupted = s.get("interrupted", False)
    title = f"# Simulation report: {name}" + (" (interrupted)" if interrupted else "")
    lines = [title, ""]
    if plots:
        lines += [f"![{alt}]({file})" for file, alt in PLOTS] + [""]
    if interrupted:
        lines.append(
            f"- interrupted after {s['requests']:,} of {s['requests_in_workload']:,} requests "
            f"({s['simulated_seconds']:.3f} simulated s); no end-of-run checks"
        )
    else:
        lines += _totals(s, result.tally)
    too_large = result.tally.too_large_line(s.get("capacity_tokens"))
    if too_large:
        lines.append(f"- {too_large}")
    if not interrupted:
        lines += _deferral_section(s)
    lines += ["", "## Requests by kind", "", "```", *kinds_table(result), "```", ""]
    lines += _request_rows(result)
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _totals(s: dict[str, Any], tally: Tally) -> list[str]:
    cap = s["capacity_tokens"]
    capacity = "unbounded (no attention group)" if cap is None else f"{cap:,} tokens"
    return [
        f"- requests: {s['requests']:,}; {tally.hit_rate_line()}",
        f"- preemptions: {s['preemptions']:,}, evicted blocks: {s['evicted_blocks']:,}, "
        f"peak usage {percent(s['peak_usage'], 1)}, capacity {capacity}",
        f"- simulated time {s['simulated_seconds']:.3f} s over {s['steps']:,} steps "
        "(cost model estimate, not a measurement)",
        f"- reconciliation: {'passed' if s['reconciled'] else 'FAILED'} {s['reconciliation']}",
    ]


def _request_rows(result: SimResult) -> list[str]:
    tally = result.tally
    lines = [
        f"## Requests (the first {min(tally.num_rows, REPORT_ROWS):,} of {tally.num_rows:,}; "
        "every one is in requests.jsonl)",
        "",
        "| id | prompt | cached | reason | preemptions | queue (s) | TTFT (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in tally.first_rows:
        queue, ttft = r["queue_s"], r["ttft_estimate_s"]
        lines.append(
            f"| {r['id']} | {r['prompt_tokens']:,} | {r['cached_tokens']:,} | {r['reason']} | "
            f"{r['preemptions']:,} | {'—' if queue is None else f'{queue:.4f}'} | "
            f"{'—' if ttft is None else f'{ttft:.4f}'} |"
        )
    return lines


def _deferral_section(s: dict[str, Any]) -> list[str]:
    """In-batch sharing: prefill computed with deferral vs a second run without it."""
    lines = [
        "",
        "## In-batch prefix sharing",
        "",
        f"Requests waited {s['deferral_waits']:,} request-steps for a prefix another request "
        f"was computing; {s['prefill_tokens_computed']:,} prefill tokens were computed.",
    ]
    off = s.get("without_deferral")
    if off:
        saved = off["prefill_tokens_computed"] - s["prefill_tokens_computed"]
        lines += [
            "",
            "| run | prefill tokens computed | reused tokens | preemptions | evicted blocks | "
            "simulated s |",
            "|---|---|---|---|---|---|",
            f"| with deferral | {s['prefill_tokens_computed']:,} | {s['hits']:,} | "
            f"{s['preemptions']:,} | {s['evicted_blocks']:,} | {s['simulated_seconds']:.3f} |",
            f"| without deferral | {off['prefill_tokens_computed']:,} | {off['hits']:,} | "
            f"{off.get('preemptions', 0):,} | {off.get('evicted_blocks', 0):,} | "
            f"{off['simulated_seconds']:.3f} |",
            "",
            f"Deferral saved {saved:,} prefill tokens."
            if saved >= 0
            else f"Deferral computed {-saved:,} more prefill tokens{_deferral_cost(s, off)}.",
        ]
    return lines
