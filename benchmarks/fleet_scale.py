#!/usr/bin/env python3
"""Does the fleet simulation scale linearly with trace length?

Replays a Mooncake trace (raw JSON lines: `timestamp`, `input_length`, `output_length`,
`hash_ids`) repeated ×1, ×2 and ×4 on a 4-replica fleet. A repeat is the trace concatenated after
itself with its timestamps shifted past the previous copy's last arrival; the import gives every
line a fresh request id, while the hash ids stay, so later copies hit what earlier ones stored,
as a longer run of the same service would.

Each case runs in its own process (so one case's heap does not slow the next) and reports the
CPU seconds of the simulation alone (`time.process_time` around `simulate_fleet`, import
excluded). Prints one JSON line per case and round, then a summary line with the median per
case and the ratio ×4 / ×1 (linear is 4.0):

    python benchmarks/fleet_scale.py TRACE.jsonl [--rounds 1] [--capacity-tokens 3000000]
        [--no-fast-forward]

`--no-fast-forward` steps every replica through the scheduler's own step (the reference the
fast-forward is held equal to), for the figures before and after.
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

REPEATS = (1, 2, 4)


def repeat_trace(lines: list[str], times: int) -> list[str]:
    """The trace `times` times in a row, each copy's timestamps shifted past the last one's."""
    rows = [json.loads(line) for line in lines if line.strip()]
    span = max(int(r["timestamp"]) for r in rows) + 1000  # one second between copies (ms)
    out = []
    for k in range(times):
        for r in rows:
            out.append(json.dumps({**r, "timestamp": int(r["timestamp"]) + k * span}))
    return out


def child(path: str, replicas: int, capacity_tokens: int, fast: bool) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fleet_bench import import_trace, node  # this folder: benchmarks/fleet_bench.py

    from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet

    workload = import_trace(path)
    if isinstance(workload, str):
        raise SystemExit(f"fleet_scale: {path}: {workload}")
    options = FleetOptions(replicas=replicas, fast_forward=fast)
    t0, w0 = time.process_time(), time.perf_counter()
    summary, _ = simulate_fleet(node(capacity_tokens), workload, options, sink=lambda row: None)
    return {
        "requests": len(workload),
        "cpu_seconds": round(time.process_time() - t0, 2),
        "wall_seconds": round(time.perf_counter() - w0, 2),
        "hit_rate": summary["hit_rate"],
    }


def run_case(trace: str, repeat: int, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable, __file__, "--child", trace,
        "--replicas", str(args.replicas), "--capacity-tokens", str(args.capacity_tokens),
        *(["--no-fast-forward"] if args.no_fast_forward else []),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()
        raise SystemExit(f"fleet_scale: ×{repeat} failed: {tail[-1] if tail else 'no output'}")
    return {"repeat": repeat, **json.loads(proc.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a Mooncake trace (raw JSON lines)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--capacity-tokens", type=int, default=3_000_000, help="per replica")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds (median taken)")
    ap.add_argument("--no-fast-forward", action="store_true", help="the step-by-step reference")
    args = ap.parse_args()
    if args.child:
        fast = not args.no_fast_forward
        print(json.dumps(child(args.trace, args.replicas, args.capacity_tokens, fast)))
        return
    try:
        lines = Path(args.trace).read_text().splitlines()
    except OSError as exc:
        raise SystemExit(f"fleet_scale: cannot read {args.trace}: {exc.strerror}") from None
    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for repeat in REPEATS:
            paths[repeat] = str(Path(tmp) / f"x{repeat}.jsonl")
            Path(paths[repeat]).write_text("\n".join(repeat_trace(lines, repeat)) + "\n")
        cpu: dict[int, list[float]] = {r: [] for r in REPEATS}
        for round_index in range(args.rounds):
            order = REPEATS if round_index % 2 == 0 else tuple(reversed(REPEATS))
            for repeat in order:
                row = {"round": round_index, **run_case(paths[repeat], repeat, args)}
                cpu[repeat].append(row["cpu_seconds"])
                print(json.dumps(row), flush=True)
    medians = {f"x{r}": statistics.median(v) for r, v in cpu.items()}
    ratio = medians["x4"] / medians["x1"] if medians["x1"] > 0 else None
    print(json.dumps({"median_cpu_seconds": medians, "ratio_x4_x1": ratio, "limit": 4.5}))


if __name__ == "__main__":
    main()
