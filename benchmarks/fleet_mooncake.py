#!/usr/bin/env python3
"""Mooncake's traces on a simulated fleet: hit rate per routing policy, per node and pooled.

Mooncake (FAST 2025, Figure 10) compares 10 prefill nodes of 3 M tokens of cache each, reading
only their own cache ("local"), with the same nodes reading one pooled store ("global"). This
script replays its conversation and synthetic traces (converted with `kvreuse workload import
mooncake`) on 10 simulated replicas of 3 M tokens (attention only, 512-token pages, one hash
unit per trace block) behind each routing policy, with a shared tier of the fleet's whole
capacity (30 M tokens) beside them. The tier changes only the hit accounting (a replica
computes what it would have fetched; see `kvreuse.fleet.simulation.tier`), so one run per
policy gives both figures: `local` (what the replicas reuse) and `with tier` (what they would
reuse reading the pool too).

Writes a JSON file of every run's summary, prints a Markdown table (policy × trace: local,
with tier, their ratio) and draws it (`--plot`, matplotlib):

    python benchmarks/fleet_mooncake.py --conversation TRACE.jsonl --synthetic TRACE.jsonl \\
        --json fleet_mooncake.json --plot docs/img/fleet_mooncake.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from fleet_bench import import_trace, node  # this folder: benchmarks/fleet_bench.py

from kvreuse.fleet import POLICIES
from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet

PAPER_RATIO = {"conversation": 2.22, "synthetic": 2.36}  # global / local hit rate, Figure 10


def run_trace(name: str, path: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    workload = import_trace(path)
    if isinstance(workload, str):
        raise SystemExit(f"fleet_mooncake: {name}: {workload}")
    dep = node(args.capacity_tokens)
    tier = args.tier_tokens or args.replicas * args.capacity_tokens
    out = []
    for policy in args.policy or POLICIES:
        print(f"{name}: {len(workload):,} requests, {policy} …", file=sys.stderr, flush=True)
        options = FleetOptions(replicas=args.replicas, policy=policy, shared_tier_tokens=tier)
        t0 = time.perf_counter()
        summary, _ = simulate_fleet(dep, workload, options, sink=lambda row: None)
        summary["trace"], summary["wall_seconds"] = name, round(time.perf_counter() - t0, 1)
        local, pooled = summary["hit_rate"], summary["shared_tier"]["hit_rate_with_tier"]
        print(f"  local {local:.1%}, with tier {pooled:.1%}", file=sys.stderr, flush=True)
        out.append(summary)
    return out


def table(runs: list[dict[str, Any]]) -> str:
    traces = list(dict.fromkeys(r["trace"] for r in runs))
    head = "| policy | " + " | ".join(
        f"{t}: local | {t}: with tier | {t}: ratio (paper {PAPER_RATIO[t]}×)" for t in traces
    )
    lines = [head + " |", "|---" * (1 + 3 * len(traces)) + "|"]
    for policy in dict.fromkeys(r["policy"] for r in runs):
        cells = []
        for t in traces:
            s = next(r for r in runs if r["trace"] == t and r["policy"] == policy)
            local, pooled = s["hit_rate"], s["shared_tier"]["hit_rate_with_tier"]
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
        rows = [next(r for r in runs if r["trace"] == t and r["policy"] == p) for p in policies]
        x = range(len(policies))
        ax.bar([i - 0.2 for i in x], [100 * r["hit_rate"] for r in rows], 0.4, label="local")
        pooled = [100 * r["shared_tier"]["hit_rate_with_tier"] for r in rows]
        ax.bar([i + 0.2 for i in x], pooled, 0.4, label="with a 30 M-token shared tier")
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
    parser.add_argument("--tier-tokens", type=int, default=None, help="default: the fleet's")
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
