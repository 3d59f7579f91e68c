#!/usr/bin/env python3
"""Digests of what a simulation produces, to show that a change left every result as it was.

    .venv/bin/python benchmarks/sim_digest.py WORKLOAD.jsonl [...] --geometry attention-16 \\
        [--geometry hybrid-dcp4] [--replicas 0,4] [--num-blocks N]

For each workload, geometry and replica count (0: `kvreuse simulate` of one replica, as the
command runs it; N ≥ 1: the fleet simulation of N replicas, policy `exact`) it runs the
simulation and prints one JSON line: `sha256` of the per-request rows (JSON, one a line, in
workload order), of the summary (JSON, sorted keys) and of the KV event stream (the core's events
of the single replica, taken after every step; the wire events every replica's mirror applied in
the fleet), the number of events, and this process's CPU seconds. Two runs of the same inputs
print the same digests; a difference names the first case where results moved.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvreuse.deployment import Deployment, resolve
from kvreuse.fleet.routing.router import Router
from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet
from kvreuse.sched import FakeEngine
from kvreuse.sim import run as sim_run
from kvreuse.sim.cost import CostModel
from kvreuse.sim.workload import read_workload


class _Digest:
    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.count = 0

    def add(self, items: list[Any]) -> None:
        for item in items:
            self.h.update(repr(item).encode())
            self.h.update(b"\n")
        self.count += len(items)


def single(dep: Deployment, workload: list[Any], events: _Digest) -> tuple[list[Any], Any]:
    """The simulator's own run, with the core's events taken after every step."""
    rows: list[Any] = []
    engine = FakeEngine(accept_rate=0.7)
    cost = CostModel.for_deployment(dep)
    run = sim_run._Run(
        dep, workload, cost, engine, rows.append, on_events=lambda _step, evs: events.add(evs)
    )
    with sim_run._cyclic_gc_paused():
        result = run.loop(None, rows)
    return rows, result.summary


def fleet(dep: Deployment, workload: list[Any], n: int, events: _Digest) -> tuple[list[Any], Any]:
    apply = Router.apply

    def recorded(router: Router, replica: int, batch: list[Any]) -> None:
        events.add([(replica, ev) for ev in batch])
        apply(router, replica, batch)

    Router.apply = recorded  # type: ignore[method-assign]
    try:
        options = FleetOptions(replicas=n, cost=CostModel.for_deployment(dep))
        summary, rows = simulate_fleet(dep, workload, options)
    finally:
        Router.apply = apply  # type: ignore[method-assign]
    return rows, summary


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="+", type=Path)
    ap.add_argument("--geometry", action="append", help="preset or TOML file (repeatable)")
    ap.add_argument("--replicas", default="0", help="comma-separated; 0 is the single simulator")
    ap.add_argument("--num-blocks", type=int, help="the pool, in blocks (default: the geometry's)")
    args = ap.parse_args()
    for path in args.workloads:
        workload = read_workload(path)
        for name in args.geometry or ["attention-16"]:
            dep = resolve(name)
            if args.num_blocks:
                dep = replace(dep, cache=replace(dep.cache, num_blocks=args.num_blocks))
            for n in (int(x) for x in args.replicas.split(",")):
                events = _Digest()
                c0 = time.process_time()
                if n == 0:
                    rows, summary = single(dep, workload, events)
                else:
                    rows, summary = fleet(dep, workload, n, events)
                cpu = time.process_time() - c0
                record = {
                    "metric": "sim_digest",
                    "workload": path.name,
                    "geometry": name,
                    "num_blocks": dep.cache.num_blocks,
                    "replicas": n,
                    "requests": len(rows),
                    "rows_sha256": sha("".join(json.dumps(r) + "\n" for r in rows)),
                    "summary_sha256": sha(json.dumps(summary, sort_keys=True)),
                    "events_sha256": events.h.hexdigest(),
                    "num_events": events.count,
                    "cpu_s": round(cpu, 3),
                }
                print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
