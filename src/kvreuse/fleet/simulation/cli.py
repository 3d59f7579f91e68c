"""`kvreuse simulate --replicas N --policy P [--policy Q …] [--store-capacity TOKENS] …`.

The fleet options of `kvreuse simulate` (`add_fleet_arguments`) and the run they ask for
(`run_fleet`): the workload on N replicas of the geometry behind the router, once per policy.
Prints one table comparing the policies (or `--json`) and writes to `--out`: `fleet.json` (every
run's summary), `fleet.md` (the table) and `fleet-requests-POLICY.jsonl` (a row per request, as
requests finish). Exit codes as `kvreuse simulate`'s: 0 done and reconciled, 1 a failed
reconciliation or requests that exceed the cache, 2 bad input or a missing extra, 130 Ctrl-C
(fleet.json and fleet.md then hold the runs that finished and say the run was interrupted).
As the run starts, the files an earlier run wrote there are removed, so none is left beside
this run's.

This module imports neither the router nor the simulation until a fleet runs, so a command
line without the `events` extra can still offer (and refuse, in one line) the options.

With `--store-capacity` the replicas share one store (kvreuse.fleet.simulation.run); the
relabelling pool `--shared-tier-capacity` once modelled is gone, and the option says so.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvreuse.core import ConfigError
from kvreuse.deployment import Deployment, GeometryError
from kvreuse.fleet import POLICIES, TEXT_MATCH_THRESHOLD
from kvreuse.fleet.options import add_load_weight
from kvreuse.sim.cli import (
    check_fit_first,
    clear_outputs,
    prepare_out,
    read_inputs,
)
from kvreuse.sim.cost import CostModel
from kvreuse.sim.progress import Progress
from kvreuse.sim.run import SimulationError
from kvreuse.sim.workload import WorkloadError, WorkloadRequest
from kvreuse.tiering import STORE_TIER
from kvreuse.vocab import int_range, number, too_many_blocks

INTERRUPTED = 130
MAX_REPLICAS = 1024


def add_fleet_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the fleet options to `kvreuse simulate`'s parser."""
    g = parser.add_argument_group("fleet: several replicas behind a router (docs/fleet.md)")
    g.add_argument(
        "--replicas",
        type=int_range(1, MAX_REPLICAS),
        default=argparse.SUPPRESS,  # absent unless given: no "(default: None)" in --help
        metavar="N",
        help="simulate N replicas of the geometry behind a router",
    )
    g.add_argument(
        "--policy",
        action="append",
        choices=POLICIES,
        default=argparse.SUPPRESS,
        help="routing policy (repeat to compare several side by side; default: exact)",
    )
    g.add_argument(
        "--shared-tier-capacity",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,  # gone: refused in one line naming --store-capacity
    )
    g.add_argument(
        "--device-only-routing",
        action="store_true",
        help="with --host-capacity / --store-capacity (one store the replicas share): the "
        "router hears only the replicas' device events (as a router that reads no medium "
        "field), not their tiers'",
    )
    add_load_weight(g, "routing cost: prefill tokens one token of a replica's load is worth")
    g.add_argument(
        "--text-match-threshold",
        type=number(0, 1),
        default=TEXT_MATCH_THRESHOLD,
        help="text-prefix: the share of the prompt a match must cover to route by it",
    )


def fleet_requested(args: argparse.Namespace) -> bool:
    """Whether any fleet option was given (then `run_fleet` handles the command)."""
    return any(hasattr(args, name) for name in ("replicas", "policy", "shared_tier_capacity"))


def _fail(message: object, code: int = 2) -> int:
    print(f"kvreuse simulate: {message}", file=sys.stderr)
    return code


def _names(policies: Iterable[str]) -> list[str]:
    return ["fleet.json", "fleet.md", *(f"fleet-requests-{p}.jsonl" for p in policies)]


def _outputs(out: Path, policies: list[str]) -> list[Path]:
    """The files a run writes, checked writable before it starts."""
    names = _names(policies)
    prepare_out(out, names)
    return [out / name for name in names]


def _check_fleet(args: argparse.Namespace, dep: Deployment, policies: list[str]) -> None:
    """Options that depend on the geometry, refused before any run (one line each)."""
    from kvreuse.fleet.routing.policy import make_policy

    # Every replica's pool is built at once in this process: the ceiling of one pool bounds
    # them together (64 replicas of the largest pool would need 190 GB).
    per, total = dep.cache.num_blocks, args.replicas * dep.cache.num_blocks
    what = f"{args.replicas} replicas × {per:,} blocks = {total:,} blocks in all"
    problem = too_many_blocks(total, what, whose="their")
    if problem is not None:
        raise GeometryError(f"{problem} in all (lower --num-blocks or --replicas)")
    for policy in policies:
        make_policy(policy, dep.cache.geometry)


def run_fleet(args: argparse.Namespace) -> int:
    """`kvreuse simulate` with the fleet options: one run per policy, one comparison table."""
    if hasattr(args, "shared_tier_capacity"):
        return _fail(
            "--shared-tier-capacity is gone: --store-capacity TOKENS gives the replicas one "
            "store they all demote to and load from (docs/tiers.md)"
        )
    if getattr(args, "replicas", None) is None:
        return _fail("--policy needs --replicas N")
    args.policy = getattr(args, "policy", None)
    policies = list(dict.fromkeys(args.policy or ["exact"]))
    try:
        dep, workload = read_inputs(args)
        cost = CostModel.for_deployment(
            dep,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            decode_step_s=args.decode_step_s,
        )
        paths = _outputs(args.out, policies)
        _check_fleet(args, dep, policies)
        check_fit_first(args, dep, workload, "kvreuse simulate")
    except ModuleNotFoundError as exc:
        return _fail(
            f"a fleet needs {exc.name}, which is not installed: pip install -e '.[events]'"
        )
    except (GeometryError, WorkloadError, ConfigError, OSError, ValueError) as exc:
        return _fail(exc)
    # an earlier run's rows of any policy, this run's or not, would pass for this run's
    clear_outputs(args.out, _names(POLICIES))
    progress = Progress(not args.quiet, "kvreuse simulate")
    summaries: list[dict[str, Any]] = []
    for policy, rows_path in zip(policies, paths[2:], strict=True):
        try:
            summaries.append(_run(args, dep, workload, cost, policy, rows_path, progress))
        except KeyboardInterrupt:
            _write_reports(args, dep, workload, summaries, paths, stopped=policy)
            return _fail(
                f"interrupted during the {policy} run; its finished requests are in "
                f"{rows_path}, the runs that finished in {paths[0]}",
                INTERRUPTED,
            )
        except (WorkloadError, SimulationError) as exc:  # found only when a prompt resolved
            return _fail(exc)
    return _report(args, dep, workload, summaries, paths)


def _run(
    args: argparse.Namespace,
    dep: Deployment,
    workload: list[WorkloadRequest],
    cost: CostModel,
    policy: str,
    rows_path: Path,
    progress: Progress,
) -> dict[str, Any]:
    """One policy's run: its rows to `rows_path` as requests finish, and its summary."""
    from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet

    options = FleetOptions(
        replicas=args.replicas,
        policy=policy,
        load_weight=args.load_weight,
        cost=cost,
        draft_accept_rate=args.draft_accept_rate,
        router_options=(("text_threshold", args.text_match_threshold),),
        score_tiers=not getattr(args, "device_only_routing", False),
        fast_forward=not getattr(args, "no_fast_forward", False),
    )
    start = time.perf_counter()
    with rows_path.open("w", encoding="utf-8") as rows:

        def write(row: dict[str, Any]) -> None:
            rows.write(json.dumps(row) + "\n")

        with progress.phase(policy, len(workload), "req") as on_progress:
            summary, _ = simulate_fleet(dep, workload, options, write, on_progress)
    summary["wall_seconds"] = round(time.perf_counter() - start, 3)
    return summary


def _write_reports(
    args: argparse.Namespace,
    dep: Deployment,
    workload: list[WorkloadRequest],
    summaries: list[dict[str, Any]],
    paths: list[Path],
    stopped: str | None = None,
) -> tuple[dict[str, Any], str]:
    """fleet.json and fleet.md, and the heading and table they show. `stopped`: the policy
    whose run Ctrl-C stopped; the runs that finished are there, and both files say so."""
    from kvreuse.fleet.simulation.summary import comparison_table

    head = (
        f"{dep.name} × {args.replicas} replicas, {len(workload):,} requests"
        + "".join(
            f", {s.name} {s.num_blocks:,} blocks "
            + ("shared by the replicas" if s.name == STORE_TIER else "per replica")
            + f" ({s.medium})"
            for s in dep.tiers
        )
        + (" (router: device events only)" if dep.tiers and args.device_only_routing else "")
        + f", load weight {args.load_weight:g}"
    )
    table = comparison_table(summaries) if summaries else "(no run finished)"
    doc = {
        "geometry": dep.name,
        "replicas": args.replicas,
        "interrupted": stopped is not None,
        "runs": summaries,
    }
    title = "# Fleet simulation" + (f" (interrupted during the {stopped} run)" if stopped else "")
    paths[0].write_text(json.dumps(doc, indent=2) + "\n")
    paths[1].write_text(f"{title}\n\n{head}\n\n```\n{table}\n```\n")
    return doc, f"{head}\n{table}"


def _report(
    args: argparse.Namespace,
    dep: Deployment,
    workload: list[WorkloadRequest],
    summaries: list[dict[str, Any]],
    paths: list[Path],
) -> int:
    doc, shown = _write_reports(args, dep, workload, summaries, paths)
    print(json.dumps(doc, indent=2) if args.json else f"{shown}\noutputs in {args.out}/")
    failed = [s["policy"] for s in summaries if not s["reconciled"]]
    too_large = next((s["too_large"] for s in summaries if s["too_large"]["count"]), None)
    if too_large:
        ids = ", ".join(too_large["ids"])
        verb = "request exceeds" if too_large["count"] == 1 else "requests exceed"
        return _fail(f"{too_large['count']:,} {verb} a replica's cache: {ids}", 1)
    if failed:
        return _fail(f"reconciliation failed for {', '.join(failed)} (see fleet.json)", 1)
    return 0
