#!/usr/bin/env python3
"""Wall-clock time of a fleet simulation: 10 replicas behind the router, on one clock.

Workloads:

* `trace-like` (always): requests drawn like a chatbot trace, generated here: each request
  extends one of a few hundred shared prefixes (system prompts and documents of 2 to 30
  blocks of 512 tokens, popularity skewed), adds its own 1 to 8 blocks, and arrives in a
  Poisson stream; the defaults give about 4,000 requests and 50 M prompt tokens, the size of
  Mooncake's synthetic trace.
* `--trace PATH`: a Mooncake-format trace (timestamp, input_length, output_length, hash_ids),
  converted with `kvreuse workload import mooncake PATH`; skipped, with a line saying why,
  when that command fails.

Each replica is an attention-only node of `--capacity-tokens` (default 3 M, Mooncake's prefill
nodes) with 512-token pages. Prints one JSON object per line: `fleet_sim_wall_s` per workload
and policy, with the simulated requests, prompt tokens, hit rate, this process's CPU seconds,
and `router_us_per_request`, the router's own time (hashing once, then the policy over every
replica), measured around `Router.query` and `Router.route`.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from typing import Any

from kvreuse.core import CacheConfig, GroupSpec
from kvreuse.deployment import Deployment
from kvreuse.fleet import POLICIES
from kvreuse.fleet.routing.router import Router
from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet
from kvreuse.sched import SchedulerConfig
from kvreuse.sim.workload import WorkloadRequest, load_workload

BLOCK = 512


def emit(metric: str, value: float | None, unit: str, **params: Any) -> None:
    print(
        json.dumps({"metric": metric, "value": value, "unit": unit, "params": params}), flush=True
    )


def node(capacity_tokens: int) -> Deployment:
    cache = CacheConfig(
        num_blocks=1 + -(-capacity_tokens // BLOCK),
        groups=[GroupSpec(kind="full", block_size=BLOCK)],
        enable_events=True,
    )
    return Deployment(f"node-{capacity_tokens // 1000}k", cache, SchedulerConfig(), None)


def trace_like(requests: int, seed: int = 0) -> list[dict[str, Any]]:
    """Shared prefixes (Zipf-like popularity), a private tail per request, Poisson arrivals."""
    rng = random.Random(seed)
    prefixes = [rng.randint(2, 30) for _ in range(300)]
    weights = [1 / (i + 1) for i in range(len(prefixes))]
    clock, lines = 0.0, []
    for i in range(requests):
        clock += rng.expovariate(4.0)  # about 4 requests a second, as the synthetic trace
        p = rng.choices(range(len(prefixes)), weights)[0]
        head = {"random": {"seed": 1_000_000 + p, "len": prefixes[p] * BLOCK}}
        tail = {
            "random": {
                "seed": 2_000_000 + i,
                "len": rng.randint(1, 8) * BLOCK - rng.randint(0, 511),
            }
        }
        lines.append(
            {
                "id": f"q{i}",
                "prompt": {"concat": [head, tail]},
                "max_tokens": rng.randint(20, 300),
                "arrival": round(clock, 3),
            }
        )
    return lines


def import_trace(path: str) -> list[WorkloadRequest] | str:
    """The trace as a workload, or why it could not be converted."""
    cmd = [sys.executable, "-m", "kvreuse", "workload", "import", "mooncake", path]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "import failed"
    return load_workload(proc.stdout.splitlines())


class RouterClock:
    """Time spent in `Router.query` and `Router.route` (the router's whole work per request)."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self._query, self._route = Router.query, Router.route

    def __enter__(self) -> RouterClock:
        clock, query, route = self, self._query, self._route

        def timed_query(router: Router, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return query(router, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0
                clock.calls += 1

        def timed_route(router: Router, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return route(router, *args, **kwargs)
            finally:
                clock.seconds += time.perf_counter() - t0

        Router.query, Router.route = timed_query, timed_route  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        Router.query, Router.route = self._query, self._route  # type: ignore[method-assign]


def bench(
    name: str, dep: Deployment, workload: list[WorkloadRequest], args: argparse.Namespace
) -> None:
    for policy in args.policy or ["exact"]:
        print(
            f"{name}: {len(workload):,} requests, {args.replicas} × {dep.name}, {policy} …",
            file=sys.stderr,
        )
        options = FleetOptions(replicas=args.replicas, policy=policy)
        with RouterClock() as clock:
            t0, c0 = time.perf_counter(), time.process_time()
            summary, _ = simulate_fleet(dep, workload, options, sink=lambda row: None)
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        emit(
            "fleet_sim_wall_s",
            round(wall, 3),
            "s",
            workload=name,
            policy=policy,
            replicas=args.replicas,
            capacity_tokens=args.capacity_tokens,
            requests=summary["requests"],
            prompt_tokens=summary["prompt_tokens"],
            hit_rate=round(summary["hit_rate"], 4),
            cpu_s=round(cpu, 3),  # this process's CPU time: robust to other load on the machine
            router_us_per_request=round(1e6 * clock.seconds / max(1, clock.calls), 1),
            router_share=round(clock.seconds / wall, 4),
            steps=summary["steps"],
            simulated_s=summary["simulated_seconds"],
            reconciled=summary["reconciled"],
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="(the output is always JSON lines)")
    parser.add_argument("--replicas", type=int, default=10)
    parser.add_argument("--capacity-tokens", type=int, default=3_000_000)
    parser.add_argument("--requests", type=int, default=4000, help="trace-like requests")
    parser.add_argument(
        "--policy", action="append", choices=POLICIES, help="repeatable (default: exact)"
    )
    parser.add_argument("--trace", help="a Mooncake-format trace (JSON lines) to simulate too")
    args = parser.parse_args()
    dep = node(args.capacity_tokens)
    generated = load_workload([json.dumps(x) for x in trace_like(args.requests)])
    bench("trace-like", dep, generated, args)
    if args.trace:
        workload = import_trace(args.trace)
        if isinstance(workload, str):
            emit("trace_unavailable", None, "", trace=args.trace, reason=workload)
        else:
            bench("mooncake-trace", dep, workload, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
