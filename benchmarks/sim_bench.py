#!/usr/bin/env python3
"""Simulated requests per second of `kvreuse simulate` (issue 3, acceptance 3).

Workload: N requests (default 10,000) sharing one 1,024-token prefix, 2,048-token prompts, 64
output tokens each, all arriving at once, on the `attention-16` and `hybrid-dcp4` presets.
Prints one JSON object per line (`metric`, `value`, `unit`, `params`); progress on stderr.
Wall-clock time (and, in `params`, this process's CPU time, which other load on a shared
machine disturbs less) covers the whole simulation (scheduler, core and fake engine), not the
workload generation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvreuse.sim.generators import shared_prefix
from kvreuse.sim.geometry import preset
from kvreuse.sim.run import simulate
from kvreuse.sim.workload import load_workload


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--presets", default="attention-16,hybrid-dcp4")
    args = ap.parse_args(argv)
    lines = shared_prefix(prefix_len=1024, suffix_len=1024, requests=args.requests, max_tokens=64)
    workload = load_workload([json.dumps(x) for x in lines])
    for name in args.presets.split(","):
        geo = preset(name)
        print(f"simulating {args.requests} requests on {name} …", file=sys.stderr)
        t0, c0 = time.perf_counter(), time.process_time()
        result = simulate(geo, workload)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        s = result.summary
        print(
            json.dumps(
                {
                    "metric": "sim_requests_per_s",
                    "value": round(args.requests / wall, 1),
                    "unit": "requests/s",
                    "params": {
                        "preset": name,
                        "requests": args.requests,
                        "prompt_tokens": 2048,
                        "shared_prefix": 1024,
                        "max_tokens": 64,
                        "wall_s": round(wall, 3),
                        # CPU time of this process: robust to other load on a shared machine
                        "cpu_s": round(cpu, 3),
                        "requests_per_cpu_s": round(args.requests / cpu, 1),
                        "steps": s["steps"],
                        "hit_rate": round(s["hit_rate"], 4),
                        "preemptions": s["preemptions"],
                        "reconciled": s["reconciled"],
                        "target": ">= 2000",
                    },
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
