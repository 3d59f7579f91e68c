#!/usr/bin/env python3
"""A sweep end to end: `kvreuse workload import`, then `kvreuse sweep`, timed.

    .venv/bin/python benchmarks/sweep_bench.py TRACE.jsonl [--format mooncake]
        [--geometry hybrid-dcp4-ckpt256 --geometry hybrid-dcp4-ckpt2048]
        [--capacity 1M,3M,10M,50M,inf] [--jobs N] [--time-scale X] [--out DIR]

Defaults: the two checkpoint presets × five capacities (ten cases) on every core. Both commands
run as child processes, as a user runs them; the benchmark reports the sweep's wall time,
the CPU time of the sweep and its workers, the peak resident set of the largest process
(ru_maxrss of the children), and each case's own wall time and hit rate from sweep.json.
Prints one JSON object per line (`metric`, `value`, `unit`, `params`); progress on stderr. The
traces are not in the repository: give the path of one (Mooncake's FAST'25 traces:
github.com/kvcache-ai/Mooncake, FAST25-release/traces).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KVREUSE = [sys.executable, "-m", "kvreuse"]


def emit(metric: str, value: float | None, unit: str, **params: Any) -> None:
    print(
        json.dumps({"metric": metric, "value": value, "unit": unit, "params": params}), flush=True
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="the trace, JSON lines")
    ap.add_argument("--format", default="mooncake", choices=("mooncake", "bailian"))
    ap.add_argument("--geometry", action="append", help="repeatable; default: the ckpt presets")
    ap.add_argument("--capacity", default="1M,3M,10M,50M,inf")
    ap.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--time-scale", default="1", help="passed to kvreuse workload import")
    ap.add_argument("--out", type=Path, help="keep the sweep's outputs here (default: a temp dir)")
    args = ap.parse_args()
    geometries = args.geometry or ["hybrid-dcp4-ckpt256", "hybrid-dcp4-ckpt2048"]
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "workload.jsonl"
        out = args.out or Path(tmp) / "sweep"
        print(f"importing {args.trace} …", file=sys.stderr)
        with workload.open("w") as f:
            imported = [*KVREUSE, "workload", "import", args.format, str(args.trace)]
            subprocess.run([*imported, "--time-scale", args.time_scale], stdout=f, check=True)
        cmd = [*KVREUSE, "sweep", str(workload), "--capacity", args.capacity, "--out", str(out)]
        cmd += [x for g in geometries for x in ("--geometry", g)]
        cmd += ["--jobs", str(args.jobs), "--quiet", "--json"]
        print(f"sweeping {len(geometries)} geometries × {args.capacity} …", file=sys.stderr)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode not in (0, 1):  # 1: a case had requests too large for its cache
            print(proc.stderr, file=sys.stderr, end="")
            return proc.returncode
        doc = json.loads(proc.stdout)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    cases = doc["cases"]
    params = {
        "trace": args.trace.name,
        "geometries": geometries,
        "capacities": args.capacity,
        "cases": len(cases),
        "jobs": args.jobs,
        "time_scale": args.time_scale,
        "cpu_s": round(cpu, 1),
        "peak_rss_mib": round(after.ru_maxrss / 1024, 1),  # the largest child (Linux: KiB)
        "exit_code": proc.returncode,
    }
    emit("sweep_wall_s", round(wall, 1), "s", **params)
    for row in cases:
        emit(
            "sweep_case_wall_s",
            row["wall_s"],
            "s",
            geometry=row["geometry"],
            capacity_tokens=row["capacity_tokens"],
            hit_rate=round(row["hit_rate"], 4),
            prefill_seconds=row["prefill_seconds"],
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
