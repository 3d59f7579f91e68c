"""`kvreuse simulate [GEOMETRY.toml] WORKLOAD.jsonl --out DIR`.

Prints a summary table (or `--json`) and writes requests.jsonl (as requests finish),
summary.json, report.md and the plots (`--no-plots` to skip them) to DIR. Exit codes: 0 done and
reconciled, 1 reconciliation failed or requests exceed the cache, 2 bad input, 130 Ctrl-C (what
finished is kept). As the run starts, the files an earlier run wrote to DIR are removed, so none
is left beside this run's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from kvreuse.core import ConfigError
from kvreuse.deployment import (
    PRESETS,
    Deployment,
    GeometryError,
    blocks_for_capacity,
    check_num_blocks,
    preset,
    resolve,
)
from kvreuse.sched import DRAFT_ACCEPT_RATE
from kvreuse.sim.fit import check_fit, never_evicting_blocks
from kvreuse.sim.progress import Progress
from kvreuse.sim.report import PLOTS, summary_table, write_report
from kvreuse.sim.run import (
    CostModel,
    SimResult,
    SimulationError,
    SimulationInterrupted,
    simulate,
    without_deferral,
)
from kvreuse.sim.traces import add_trace_options, read_workload_arg
from kvreuse.sim.workload import WorkloadError, WorkloadRequest
from kvreuse.tiering import with_tiers
from kvreuse.vocab import Help, add_num_blocks, add_tier_options, number, size

DEFAULT_COST = CostModel()
OUTPUTS = ("requests.jsonl", "summary.json", "report.md", *(f for f, _ in PLOTS))
INTERRUPTED = 130  # the shell's code for a command stopped by Ctrl-C (128 + SIGINT)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "simulate",
        help="replay a workload on a cache geometry",
        description="Replay a workload through the scheduler and the cache manager on a cache "
        "geometry (a preset or a TOML file); print a summary and write requests.jsonl, "
        "summary.json, report.md and plots to --out. Exit codes: 0 done and reconciled; 1 a "
        "reconciliation check failed or requests exceed the cache; 2 bad input; 130 Ctrl-C.",
        formatter_class=Help,
    )
    p.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help="GEOMETRY.toml WORKLOAD.jsonl, or WORKLOAD.jsonl with --geometry (with --trace, "
        "a trace instead of the workload)",
    )
    p.add_argument(
        "--geometry",
        dest="preset",
        choices=sorted(PRESETS),
        help="a preset instead of a geometry file (kvreuse geometry list)",
    )
    p.add_argument("--out", type=Path, required=True, help="output folder (created if missing)")
    pool = p.add_mutually_exclusive_group()
    add_num_blocks(pool, "the pool, in blocks, the null block included (default: the geometry's)")
    pool.add_argument(
        "--capacity-tokens",
        type=size(1, 2**63 - 1, unlimited=True),
        default=None,
        metavar="N",
        help="the pool: as many blocks as one request of N tokens needs (3M, 1.5G; inf: "
        "a pool that never evicts; default: the geometry's)",
    )
    add_tier_options(p.add_argument_group("memory tiers (docs/tiers.md)"), "the pool")
    add_trace_options(p)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bars on stderr")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib)")
    p.add_argument(
        "--no-compare",
        action="store_true",
        help="when requests waited for a shared prefix, skip the second run without deferral",
    )
    p.add_argument(
        "--prefill-tokens-per-s",
        type=number(1, 1e12),
        default=None,
        help="cost model: prefill throughput, tokens per second (default: the geometry's "
        f"[cost], else {DEFAULT_COST.prefill_tokens_per_s:,.0f})",
    )
    p.add_argument(
        "--decode-step-s",
        type=number(0, 3600),
        default=None,
        help="cost model: seconds of a step that decodes (default: the geometry's [cost], "
        f"else {DEFAULT_COST.decode_step_s:g})",
    )
    p.add_argument(
        "--no-fast-forward",
        action="store_true",
        help="take every step through the scheduler (the reference path; same results, slower)",
    )
    add_draft_accept_rate(p)
    p.set_defaults(func=run)


def add_draft_accept_rate(p: Any) -> None:
    """`--draft-accept-rate P` of `kvreuse simulate` and `sweep`: the fake engine's acceptance."""
    p.add_argument(
        "--draft-accept-rate",
        type=number(0, 1),
        default=DRAFT_ACCEPT_RATE,
        help="with num_spec_tokens > 0: probability that each draft token is accepted",
    )


def _fail(message: object, code: int = 2) -> int:
    print(f"kvreuse simulate: {message}", file=sys.stderr)
    return code


def read_inputs(args: argparse.Namespace) -> tuple[Deployment, list[WorkloadRequest]]:
    """The deployment (its pool resized by --num-blocks / --capacity-tokens) and the workload
    of `kvreuse simulate`'s arguments, for the single and the fleet simulation alike."""
    if args.preset:
        if len(args.files) != 1:
            raise GeometryError("with --geometry, give only the workload file")
        dep, wl_path = preset(args.preset), Path(args.files[0])
    else:
        if len(args.files) != 2:
            raise GeometryError("give GEOMETRY.toml and WORKLOAD.jsonl (or --geometry NAME)")
        dep, wl_path = resolve(Path(args.files[0])), Path(args.files[1])
    workload = read_workload_arg(wl_path, args, "kvreuse simulate")
    if args.capacity_tokens == math.inf:
        dep = with_pool(dep, never_evicting_blocks(dep, workload), None)
        return dep, workload
    dep = with_pool(dep, args.num_blocks, args.capacity_tokens)
    tiers = args.host_capacity, args.store_capacity, args.store_admission
    return with_tiers(dep, *tiers), workload


def with_pool(dep: Deployment, num_blocks: int | None, capacity_tokens: int | None) -> Deployment:
    """`dep` with its pool resized: `num_blocks`, or the blocks `capacity_tokens` need (as the
    geometry file's keys of the same names; neither: as it is)."""
    if capacity_tokens is not None:
        num_blocks = blocks_for_capacity(dep.cache, capacity_tokens)
        because = f" (for --capacity-tokens {capacity_tokens:,})"
    elif num_blocks is None:
        return dep
    else:
        because = ""
    check_num_blocks(num_blocks, "--num-blocks" if not because else "--capacity-tokens", because)
    return replace(dep, cache=replace(dep.cache, num_blocks=num_blocks))


def check_fit_first(
    args: argparse.Namespace, dep: Deployment, workload: list[WorkloadRequest], prog: str
) -> None:
    """Requests the pool can never hold, said before the run: on a preset's own pool (no
    --num-blocks or --capacity-tokens) a GeometryError naming the capacity that fits them, on
    a pool the user chose one line on stderr, and the run goes on (and exits 1)."""
    fit = check_fit(dep, workload)
    if not fit.num_too_large:
        return
    if args.preset and args.num_blocks is None and args.capacity_tokens is None:
        raise GeometryError(fit.message(dep))
    print(f"{prog}: {fit.message(dep)}", file=sys.stderr)


def _require_matplotlib() -> None:
    """Found out before the run, not after it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "the plots need matplotlib, which is not installed: pip install -e '.[sim]' "
            "(or pass --no-plots)"
        ) from None


def prepare_out(out: Path, outputs: Iterable[str] = OUTPUTS) -> None:
    """Create `out` and check that every output file can be written there, before the run."""
    if out.exists() and not out.is_dir():
        raise OSError(f"--out {out}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"--out {out}: cannot create the directory ({exc.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise OSError(f"--out {out}: the directory is not writable")
    for name in outputs:
        path = out / name
        if path.exists() and (not path.is_file() or not os.access(path, os.W_OK)):
            raise OSError(f"--out {out}: {name} exists and cannot be overwritten")


def clear_outputs(out: Path, names: Iterable[str] = OUTPUTS) -> None:
    """Remove the files an earlier run wrote to `out` under `names`, once every check has
    passed and this run starts: whenever it stops, no file there describes another run."""
    for name in names:
        path = out / name
        if path.is_file() or path.is_symlink():
            path.unlink()


def run(args: argparse.Namespace) -> int:
    try:
        dep, workload = read_inputs(args)
        cost = CostModel.for_deployment(  # the geometry's [cost], then the options given
            dep, prefill_tokens_per_s=args.prefill_tokens_per_s, decode_step_s=args.decode_step_s
        )
        if not args.no_plots:
            _require_matplotlib()
        prepare_out(args.out)
        check_fit_first(args, dep, workload, "kvreuse simulate")
    except (GeometryError, WorkloadError, ConfigError, OSError, ValueError) as exc:
        return _fail(exc)
    clear_outputs(args.out)
    progress = Progress(not args.quiet, "kvreuse simulate")
    with (args.out / "requests.jsonl").open("w", encoding="utf-8") as rows:
        try:
            with progress.phase("simulating", len(workload), "req") as on_step:
                result = simulate(
                    dep,
                    workload,
                    cost,
                    on_step,
                    args.draft_accept_rate,
                    sink=_writer(rows),
                    fast_forward=not args.no_fast_forward,
                )
        except SimulationInterrupted as stop:
            return _interrupted(args, dep, stop.result)
        except (WorkloadError, SimulationError) as exc:  # found only when a prompt resolved
            return _fail(exc)
    return _finish(args, dep, workload, cost, result, progress)


def _writer(f: TextIO) -> Callable[[dict[str, Any]], None]:
    def write(row: dict[str, Any]) -> None:
        f.write(json.dumps(row) + "\n")

    return write


def _finish(
    args: argparse.Namespace,
    dep: Deployment,
    workload: list[WorkloadRequest],
    cost: CostModel,
    result: SimResult,
    progress: Progress,
) -> int:
    """The comparison run, the outputs and the exit code of a run that finished."""
    stopped = None
    s = result.summary
    if s["deferral_waits"] and not args.no_compare:
        try:
            with progress.phase("comparing without deferral", len(workload), "req") as on_step:
                rate = args.draft_accept_rate
                fast = not args.no_fast_forward
                s["without_deferral"] = without_deferral(dep, workload, cost, rate, on_step, fast)
        except KeyboardInterrupt:
            stopped = "the comparison run without deferral"
    plots = not args.no_plots and stopped is None
    if plots:
        try:
            from kvreuse.sim.plots import write_plots

            with progress.phase("plotting", len(PLOTS), "plot") as on_plot:
                write_plots(args.out, dep.name, result, on_plot)
        except KeyboardInterrupt:
            _remove_plots(args.out)
            stopped, plots = "plotting", False
    (args.out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    write_report(args.out, dep.name, result, plots)
    print(json.dumps(s, indent=2) if args.json else summary_table(dep.name, result, args.out))
    if stopped:
        return _fail(
            f"interrupted during {stopped}; the simulation's results are complete in {args.out}/",
            INTERRUPTED,
        )
    too_large = result.tally.too_large_line(s["capacity_tokens"])
    if too_large:
        return _fail(f"{too_large}; raise num_blocks or shorten them", 1)
    if not s["reconciled"]:
        failed = [k for k, ok in s["reconciliation"].items() if not ok]
        return _fail(f"reconciliation failed: {failed}", 1)
    return 0


def _remove_plots(out: Path) -> None:
    """Plots of an interrupted plotting would pass for complete ones."""
    for name, _ in PLOTS:
        (out / name).unlink(missing_ok=True)


def _interrupted(args: argparse.Namespace, dep: Deployment, result: SimResult) -> int:
    s = result.summary
    (args.out / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    write_report(args.out, dep.name, result, plots=False)
    return _fail(
        f"interrupted after {s['requests']:,} of {s['requests_in_workload']:,} requests; "
        f"the finished ones are in {args.out}/requests.jsonl",
        INTERRUPTED,
    )
