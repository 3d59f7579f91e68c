#!/usr/bin/env python3
"""Mooncake's traces on a simulated fleet: hit rate per routing policy, per node and pooled.

Mooncake (FAST 2025, Figure 10) compares 10 prefill nodes of 3 M tokens of cache each, reading
only their own cache ("local"), with the same nodes reading one pooled store ("global"). This
script replays its conversation and synthetic traces (converted with `kvreuse workload import
mooncake`) on 10 simulated replicas of 3 M tokens (attention only, 512-token pages, one hash
unit per trace block) behind each routing policy, twice: the replicas alone (`local`), and the
same replicas sharing one store of the fleet's whole capacity (30 M tokens) that every block is
written through to as it is computed (`with store`): a replica loads from it what another
computed, and pays the load in the cost model.

Writes a JSON file of every run's summary, prints a Markdown table (policy × trace: local,
with store, their ratio) and draws it (`--plot`, matplotlib):

    python benchmarks/fleet_mooncake.py --conversation TRACE.jsonl --synthetic TRACE.jsonl \\
        --json fleet_mooncake.json --plot docs/img/fleet_mooncake.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fleet_bench import import_trace, node  # this folder: benchmarks/fleet_bench.py

from kvreuse.core import Admission, TierSpec
from kvreuse.fleet import POLICIES
from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet

PAPER_RATIO = {"conversation": 2.22, "synthetic": 2.36}  # global / local hit rate, Figure 10


def run_trace(name: str, path: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    workload = import_trace(path)
    if isinstance(workload, str):
        raise SystemExit(f"fleet_mooncake: {name}: {workload}")
    dep = node(args.capacity_tokens)
    tokens = args.store_tokens or args.replicas * args.capacity_tokens
    store = TierSpec("store", dep.cache.blocks_for_request(tokens), default=Admission.WRITE_THROUGH)
    out = []
    for policy in args.policy or POLICIES:
        options = FleetOptions(replicas=args.replicas, policy=policy)
        for case, d in (("local", dep), ("store", replace(dep, tiers=(store,)))):
            print(f"{name}: {len(workload):,} requests, {policy}, {case} …", file=sys.stderr)
            t0 = time.perf_counter()
            summary, _ = simulate_fleet(d, workload, options, sink=lambda row: None)
            summary["trace"], summary["case"] = name, case
            summary["wall_seconds"] = round(time.perf_counter() - t0, 1)
            print(f"  hit rate {summary['hit_rate']:.1%}", file=sys.stderr, flush=True)
            out.append(summary)
    return out


def pick(runs: list[dict[str, Any]], trace: str, policy: str, case: str) -> dict[str, Any]:
    return next(r for r in runs if (r["trace"], r["policy"], r["case"]) == (trace, policy, case))


def table(runs: list[dict[str, Any]]) -> str:
    traces = list(dict.fromkeys(r["trace"] for r in runs))
    head = "| policy | " + " | ".join(
        f"{t}: local | {t}: with store | {t}: ratio (paper {PAPER_RATIO[t]}×)" for t in traces
    )
    lines = [head + " |", "|---" * (1 + 3 * len(traces)) + "|"]
    for policy in dict.fromkeys(r["policy"] for r in runs):
        cells = []
        for t in traces:
            local = pick(runs, t, policy, "local")["hit_rate"]
            pooled = pick(runs, t, policy, "store")["hit_rate"]
            cells += [f"{local:.1%}", f"{pooled:.1%}", f"{pooled / local:.2f}×" if local else "—"]
        lines.append(f"| {policy} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in runs))
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    fig, axes = plt.subplots(1, len(traces), figsize=(5.5 * len(traces), 4), squeeze=False)
    for ax, t in zip(axes[0], traces, strict=True):
        x = range(len(policies))
        local = [100 * pick(runs, t, p, "local")["hit_rate"] for p in policies]
        pooled = [100 * pick(runs, t, p, "store")["hit_rate"] for p in policies]
        ax.bar([i - 0.2 for i in x], local, 0.4, label="local")
        ax.bar([i + 0.2 for i in x], pooled, 0.4, label="sharing a 30 M-token store")
        ax.set_xticks(list(x), policies, rotation=20)
        ax.set_ylabel("prompt tokens reused (%)")
        ax.set_title(f"Mooncake {t} trace, 10 × 3 M-token replicas")
        ax.set_ylim(0, 100)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversation", help="Mooncake's conversation_trace.jsonl")
    parser.add_argument("--synthetic", help="Mooncake's synthetic_trace.jsonl")
    parser.add_argument("--replicas", type=int, default=10)
    parser.add_argument("--capacity-tokens", type=int, default=3_000_000)
    parser.add_argument("--store-tokens", type=int, default=None, help="default: the fleet's")
    parser.add_argument("--policy", action="append", choices=POLICIES, help="default: all")
    parser.add_argument("--json", type=Path, default=None, help="write every run's summary here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the table as a PNG here")
    args = parser.parse_args()
    traces = [
        (n, p) for n, p in (("conversation", args.conversation), ("synthetic", args.synthetic)) if p
    ]
    if not traces:
        parser.error("give --conversation and/or --synthetic")
    runs = [s for name, path in traces for s in run_trace(name, path, args)]
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2) + "\n")
    if args.plot:
        plot(runs, args.plot)
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
