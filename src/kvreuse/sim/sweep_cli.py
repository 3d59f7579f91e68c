"""`kvreuse sweep WORKLOAD.jsonl --geometry A --geometry B --capacity 1M,3M,inf --out DIR`.

Every (geometry, tiers, capacity) is one `kvreuse simulate` run (`--tiers none --tiers
host=30M` compares tier setups below each pool), in parallel on local processes
(`--jobs`, default: every core) or as Ray tasks (`--ray [ADDRESS]`). Prints one table and writes
DIR/sweep.md (the table and the plots), DIR/sweep.json (every case's figures) and, unless
--no-plots, DIR/hit_rate_vs_capacity.png and DIR/prefill_time.png. Exit codes: 0 done; 1 a
case failed reconciliation or has requests that exceed its cache; 2 bad input; 130 Ctrl-C
(the finished cases are kept, in a sweep.json and sweep.md that say the sweep was interrupted).
As the sweep starts, the files an earlier one wrote to DIR are removed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from kvreuse.core import ConfigError
from kvreuse.deployment import Deployment, GeometryError, resolve
from kvreuse.sim.cli import add_draft_accept_rate, clear_outputs, prepare_out
from kvreuse.sim.cost import CostModel
from kvreuse.sim.progress import Progress
from kvreuse.sim.sweep import (
    CaseError,
    Row,
    TierSetup,
    cases_for,
    parse_capacities,
    parse_tier_setup,
    run_cases,
    run_cases_on_ray,
)
from kvreuse.sim.traces import add_trace_options, read_workload_arg
from kvreuse.sim.workload import WorkloadError
from kvreuse.vocab import Help, add_tier_options, exact_size, int_range, plural

DEFAULT_CAPACITIES = "1M,3M,10M,50M,inf"
PLOTS = ("hit_rate_vs_capacity.png", "prefill_time.png")
OUTPUTS = ("sweep.md", "sweep.json", *PLOTS)
LOCAL_RAY = ""  # --ray without an address: start a local Ray instance
INTERRUPTED = 130


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "sweep",
        help="simulate a workload on several geometries and cache capacities",
        description="Simulate a workload on every (geometry, cache capacity) pair and compare "
        "them in one table (DIR/sweep.md, DIR/sweep.json) and two plots. Exit codes: 0 done; "
        "1 a case failed its reconciliation or has requests that never fit its cache; 2 bad "
        "input; 130 Ctrl-C (the finished cases are kept).",
        formatter_class=Help,
    )
    p.add_argument(
        "workload",
        type=Path,
        metavar="WORKLOAD",
        help="a workload JSONL file (or, with --trace, a trace)",
    )
    add_trace_options(p)
    p.add_argument(
        "--geometry",
        action="append",
        required=True,
        metavar="GEOMETRY",
        help="a preset or a .toml geometry file; repeat it for each geometry to compare",
    )
    p.add_argument(
        "--capacity",
        default=DEFAULT_CAPACITIES,
        help="comma-separated cache capacities in tokens: integers, K/M/G = 10^3/10^6/10^9 "
        "tokens, inf = a pool that never evicts",
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (created if missing)")
    p.add_argument(
        "--jobs",
        type=int_range(1, 1024),
        default=_cores(),
        help="cases run at once on local processes (1: one after another, in this process; "
        "default: every core)",
    )
    p.add_argument(
        "--ray",
        nargs="?",
        const=LOCAL_RAY,
        default=None,
        metavar="ADDRESS",
        help="run the cases as Ray tasks: on the cluster at ADDRESS, or a local one "
        "(needs pip install 'kvreuse[ray]')",
    )
    add_draft_accept_rate(p)
    add_tier_options(p, "every case's pool")
    p.add_argument(
        "--tiers",
        action="append",
        type=_tier_setup,
        metavar="SETUP",
        help="tiers below every case's pool, as one setup to compare: none, host=N, store=N "
        "or host=N,store=N (tokens, as --host-capacity); repeat it for each setup (instead "
        "of --host-capacity and --store-capacity)",
    )
    p.add_argument("--json", action="store_true", help="print sweep.json instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib)")
    p.set_defaults(func=run)


def _fail(message: object, code: int = 2) -> int:
    print(f"kvreuse sweep: {message}", file=sys.stderr)
    return code


def _deployments(specs: list[str]) -> list[tuple[str, Deployment]]:
    out: list[tuple[str, Deployment]] = []
    for spec in specs:
        if any(label == spec for label, _ in out):
            raise GeometryError(f"--geometry {spec} is given twice")
        out.append((spec, resolve(spec)))
    return out


def _tier_setup(text: str) -> TierSetup:
    try:
        return parse_tier_setup(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _setups(args: argparse.Namespace) -> tuple[TierSetup, ...]:
    if args.tiers is None:
        return (TierSetup(args.host_capacity, args.store_capacity),)
    if args.host_capacity is not None or args.store_capacity is not None:
        raise ValueError(
            "--tiers gives each setup its sizes: leave out --host-capacity and --store-capacity"
        )
    if len(set(args.tiers)) != len(args.tiers):
        raise ValueError("--tiers: a setup is given twice")
    return tuple(args.tiers)


def _check_options(args: argparse.Namespace) -> None:
    """Everything that can be found out before a case runs."""
    if args.ray is not None and find_spec("ray") is None:
        raise ValueError(
            "--ray needs the ray package, which is not installed: pip install 'kvreuse[ray]'"
        )
    if not args.no_plots and find_spec("matplotlib") is None:
        raise ValueError(
            "the plots need matplotlib, which is not installed: "
            "pip install -e '.[sim]' (or pass --no-plots)"
        )
    prepare_out(args.out, OUTPUTS)


def run(args: argparse.Namespace) -> int:
    try:
        capacities = parse_capacities(args.capacity)
        setups = _setups(args)
        _check_options(args)
        deployments = _deployments(args.geometry)
        workload = read_workload_arg(args.workload, args, "kvreuse sweep")
        cases = cases_for(deployments, capacities, workload, setups, args.store_admission)
    except (GeometryError, ConfigError, WorkloadError, OSError, ValueError) as exc:
        return _fail(exc)
    clear_outputs(args.out, OUTPUTS)
    progress = Progress(not args.quiet, "kvreuse sweep")
    done: list[Row] = []
    started = time.monotonic()
    try:
        with progress.phase(f"{len(cases)} cases", len(cases), "case") as on_case:
            if args.ray is not None:
                address = args.ray or None
                rows = run_cases_on_ray(
                    cases, workload, address, args.draft_accept_rate, on_case, done
                )
            else:
                rows = run_cases(cases, workload, args.jobs, args.draft_accept_rate, on_case, done)
    except CaseError as exc:
        return _fail(exc)
    except ConnectionError as exc:  # Ray could not reach ADDRESS
        return _fail(f"--ray {args.ray}: {exc}")
    except KeyboardInterrupt:
        _write(args, deployments, capacities, done, time.monotonic() - started, interrupted=True)
        return _fail(
            f"interrupted after {len(done)} of {len(cases)} cases; they are in "
            f"{args.out}/sweep.json",
            INTERRUPTED,
        )
    elapsed = time.monotonic() - started
    doc = _write(args, deployments, capacities, rows, elapsed, interrupted=False)
    print(json.dumps(doc, indent=2) if args.json else "\n".join(sweep_table(rows)))
    if not args.quiet:
        rate = len(rows) / elapsed if elapsed > 0 else math.inf
        print(
            f"kvreuse sweep: {plural(len(rows), 'case')} in {elapsed:,.1f} s ({rate:.3g} cases/s)",
            file=sys.stderr,
        )
    return _verdict(rows)


def _verdict(rows: list[Row]) -> int:
    failed = [_name(r) for r in rows if not r["reconciled"]]
    if failed:
        return _fail(f"reconciliation failed in {', '.join(failed)}", 1)
    too_large = [f"{_name(r)} ({r['too_large']:,})" for r in rows if r["too_large"]]
    if too_large:
        return _fail(
            f"requests exceed the cache in {', '.join(too_large)}; their tokens count as not "
            "cached: raise those capacities",
            1,
        )
    return 0


def _name(row: Row) -> str:
    tiers = row.get("tier_setup", "device only")
    where = "" if tiers == "device only" else f" ({tiers})"
    return f"{row['geometry']} at {exact_size(row['capacity_tokens'])}{where}"


def _write(
    args: argparse.Namespace,
    deployments: list[tuple[str, Deployment]],
    capacities: list[int | None],
    rows: list[Row],
    elapsed_s: float,
    interrupted: bool,
) -> dict[str, Any]:
    out: Path = args.out
    doc = {
        "workload": str(args.workload),
        "geometries": [
            {"geometry": label, "cost": _cost_fields(dep)} for label, dep in deployments
        ],
        "capacities": [exact_size(c) for c in capacities],
        "interrupted": interrupted,
        # the sweep's own wall time (the cases' wall_s add up to more with --jobs > 1)
        "elapsed_s": round(elapsed_s, 3),
        "cases_per_s": round(len(rows) / elapsed_s, 4) if elapsed_s > 0 else None,
        "cases": rows,
    }
    (out / "sweep.json").write_text(json.dumps(doc, indent=2) + "\n")
    plots = not args.no_plots and not interrupted and bool(rows)
    if plots:
        from kvreuse.sim.sweep_plots import write_plots

        write_plots(out, rows)
    (out / "sweep.md").write_text(_report(args, rows, plots, interrupted))
    return doc


def _cost_fields(dep: Deployment) -> dict[str, float]:
    model = CostModel.for_deployment(dep)
    return {
        "prefill_tokens_per_s": model.prefill_tokens_per_s,
        "decode_step_s": model.decode_step_s,
        "saved_state_s": model.saved_state_s,
        "prefill_chunk_s": model.prefill_chunk_s,
    }


def _report(args: argparse.Namespace, rows: list[Row], plots: bool, interrupted: bool) -> str:
    lines = [f"# Sweep of {args.workload}", ""]
    if interrupted:
        lines += ["**Interrupted**: only the cases that finished are here.", ""]
    lines += [
        *sweep_table(rows),
        "",
        "Capacity in tokens (1M = 10^6; inf: nothing is evicted) is the pool a geometry file's "
        "`capacity_tokens` gives. Seconds are cost-model estimates (each geometry's [cost]); "
        "TTFT percentiles are over the requests that produced a token.",
    ]
    if plots:
        lines += ["", *(f"![{name}]({name})" for name in PLOTS)]
    return "\n".join(lines) + "\n"


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _tier_tokens(row: Row) -> int:
    """Hit tokens the case's tiers gave back (first admissions)."""
    tiers = row.get("tiers", {})
    return sum(t["hit_tokens"] for t in tiers.values() if isinstance(t, dict))


def sweep_table(rows: list[Row]) -> list[str]:
    """One Markdown table row per case (readable as is on a terminal); with tiers below a
    pool, the case's tier setup and the hit tokens its tiers gave back."""
    tiered = any(r.get("tier_setup", "device only") != "device only" for r in rows)

    def cells(r: Row) -> list[tuple[str, str]]:
        out = [("geometry", r["geometry"])]
        out += [("tiers", r["tier_setup"])] if tiered else []
        out += [
            ("capacity", exact_size(r["capacity_tokens"])),
            ("blocks", f"{r['num_blocks']:,}"),
            ("hit rate", f"{100 * r['hit_rate']:.1f} %"),
            ("Σ cached", f"{r['cached_tokens']:,}"),
        ]
        out += [("from tiers", f"{_tier_tokens(r):,}")] if tiered else []
        return [
            *out,
            ("prefill tokens", f"{r['prefill_tokens']:,}"),
            ("prefill s", _seconds(r["prefill_seconds"])),
            ("TTFT p50 s", _seconds(r["ttft_p50_s"])),
            ("p90 s", _seconds(r["ttft_p90_s"])),
            ("p99 s", _seconds(r["ttft_p99_s"])),
            ("preemptions", f"{r['preemptions']:,}"),
            ("evicted", f"{r['evicted_blocks']:,}"),
        ]

    head = tuple(h for h, _ in cells(rows[0])) if rows else ()
    body = [tuple(v for _, v in cells(r)) for r in rows]
    widths = [max([len(h), *(len(c[i]) for c in body)]) for i, h in enumerate(head)]
    left = {i for i, h in enumerate(head) if h in ("geometry", "tiers", "capacity")}

    def line(values: tuple[str, ...]) -> str:
        parts = [
            v.ljust(w) if i in left else v.rjust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "| " + " | ".join(parts) + " |"

    rule = (
        "|"
        + "|".join("-" * (w + 1) + ("-" if i in left else ":") for i, w in enumerate(widths))
        + "|"
    )
    return [line(head), rule, *(line(c) for c in body)]
