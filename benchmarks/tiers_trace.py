#!/usr/bin/env python3
"""A public trace on a geometry with and without memory tiers below the pool.

    .venv/bin/python benchmarks/tiers_trace.py WORKLOAD.jsonl [--geometry hybrid-dcp4]
        [--device 3M] [--host 30M] [--store 20M] [--host-with-store 10M]
    .venv/bin/python benchmarks/tiers_trace.py WORKLOAD.jsonl --replicas 4 [--device 1M]
        [--host 8M]

WORKLOAD.jsonl is a trace already imported (`kvreuse workload import mooncake TRACE.jsonl >
WORKLOAD.jsonl`). Four runs of `kvreuse simulate`, each a child process as a user runs it:

    device        the device pool alone (--device tokens)
    +host         the same pool with a host tier (--host tokens)
    +host+store   the pool, a smaller host tier (--host-with-store) and a store (--store)
    one-device    a single device pool as large as the first and the host together

One JSON object per line per run (`metric` "hit_rate", `value`, `params`: the capacities, the
hit tokens each tier gave, the simulated seconds spent loading from each, the mean and median
TTFT estimate, evictions, and the child's wall seconds); progress on stderr.

With `--replicas N`, two fleet simulations of N replicas behind the `exact` router, each
replica with the --device pool and a --host tier:

    tier-aware    the router scores each replica's device and host (a host hit priced by its load)
    device-only   the router scores devices only (`--device-only-routing`), the tiers still there
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvreuse.vocab import parse_size as args_parse_size

KVREUSE = [sys.executable, "-m", "kvreuse"]


def parse_size(text: str) -> int:
    """A size as the command line reads it (3M, 1.5G), by kvreuse's own parser."""
    value = args_parse_size(text, 1, 2**63 - 1)
    assert value is not None  # no `inf` without `unlimited`
    return value


def run_case(workload: Path, geometry: str, name: str, pool: int, tiers: dict[str, int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = [*KVREUSE, "simulate", "--geometry", geometry, "--capacity-tokens", str(pool)]
        for tier, tokens in tiers.items():
            cmd += [f"--{tier}-capacity", str(tokens)]
        cmd += [str(workload), "--out", str(out), "--no-compare", "--no-plots", "--quiet"]
        print(f"tiers_trace: {name}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        start = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - start
        if done.returncode not in (0, 1):
            raise SystemExit(f"tiers_trace: {name} failed: {done.stderr.strip()[-2000:]}")
        summary = json.loads((out / "summary.json").read_text())
        ttft = [
            json.loads(line)["ttft_estimate_s"]
            for line in (out / "requests.jsonl").read_text().splitlines()
        ]
    per_tier = summary.get("tiers", {})
    params: dict[str, Any] = {
        "case": name,
        "geometry": geometry,
        "device_tokens": pool,
        **{f"{t}_tokens": n for t, n in tiers.items()},
        "hits": summary["hits"],
        "queries": summary["queries"],
        "evicted_blocks": summary["evicted_blocks"],
        "ttft_mean_s": round(statistics.fmean(ttft), 4),
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "simulated_seconds": summary["simulated_seconds"],
        "reconciled": summary["reconciled"],
        "wall_s": round(wall, 1),
    }
    for tier in ("host", "store"):
        if tier in per_tier:
            params[f"{tier}_hit_tokens"] = per_tier[tier]["hit_tokens"]
            params[f"{tier}_load_seconds"] = per_tier[tier]["load_seconds"]
    print(
        json.dumps(
            {"metric": "hit_rate", "value": summary["hit_rate"], "unit": "", "params": params}
        ),
        flush=True,
    )


def run_fleet_case(
    workload: Path, geometry: str, name: str, replicas: int, pool: int, host: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = [*KVREUSE, "simulate", "--geometry", geometry, "--capacity-tokens", str(pool)]
        cmd += ["--host-capacity", str(host), "--replicas", str(replicas), "--policy", "exact"]
        cmd += [str(workload), "--out", str(out), "--no-plots", "--quiet"]
        if name == "device-only":
            cmd.append("--device-only-routing")
        print(f"tiers_trace: {name}: {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
        start = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.monotonic() - start
        if done.returncode != 0:
            raise SystemExit(f"tiers_trace: {name} failed: {done.stderr.strip()[-2000:]}")
        run = json.loads((out / "fleet.json").read_text())["runs"][0]
    host_tier = run["tiers"]["host"]
    params: dict[str, Any] = {
        "case": name,
        "geometry": geometry,
        "replicas": replicas,
        "device_tokens": pool,
        "host_tokens": host,
        "ttft_mean_s": run["ttft_mean_s"],
        "host_hit_tokens": host_tier["hit_tokens"],
        "host_load_seconds": host_tier["load_seconds"],
        "predicted_host_tokens": host_tier["predicted_hit_tokens"],
        "over_predicted": run["prediction"]["over_predicted"],
        "reconciled": run["reconciled"],
        "wall_s": round(wall, 1),
    }
    line = {"metric": "hit_rate", "value": run["hit_rate"], "unit": "", "params": params}
    print(json.dumps(line), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("workload", type=Path, help="an imported trace (kvreuse workload import)")
    ap.add_argument("--geometry", default="hybrid-dcp4")
    ap.add_argument("--device", type=parse_size, default=parse_size("3M"))
    ap.add_argument("--host", type=parse_size, default=parse_size("30M"))
    ap.add_argument("--host-with-store", type=parse_size, default=parse_size("10M"))
    ap.add_argument("--store", type=parse_size, default=parse_size("20M"))
    ap.add_argument("--replicas", type=int, default=None, help="a fleet of N replicas instead")
    args = ap.parse_args(argv)
    if not args.workload.is_file():
        print(f"tiers_trace: no such workload file: {args.workload}", file=sys.stderr)
        return 2
    d = args.device
    if args.replicas is not None:
        if args.replicas < 1:
            print(f"tiers_trace: --replicas must be ≥ 1 (got {args.replicas})", file=sys.stderr)
            return 2
        for name in ("tier-aware", "device-only"):
            run_fleet_case(args.workload, args.geometry, name, args.replicas, d, args.host)
        return 0
    run_case(args.workload, args.geometry, "device", d, {})
    run_case(args.workload, args.geometry, "+host", d, {"host": args.host})
    both = {"host": args.host_with_store, "store": args.store}
    run_case(args.workload, args.geometry, "+host+store", d, both)
    run_case(args.workload, args.geometry, "one-device", d + args.host, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
