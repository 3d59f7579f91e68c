#!/usr/bin/env python3
"""NVIDIA Dynamo's mocker replays a Mooncake trace offline; run with `.venv-mocker/bin/python`
(built by benchmarks/mocker/setup_venv.sh). benchmarks/mocker_bench.py starts it as a child
process and measures that process's CPU time.

    replay.py run TRACE --blocks N --report REPORT.jsonl [--block-size 512] [--max-num-seqs 256]
        [--max-num-batched-tokens 8192]
    replay.py calibrate --blocks N [--block-size 512] [--max-num-batched-tokens 8192]

`run` prints one JSON object: the replay's summary (the keys below), and the CPU and wall
seconds of the replay call alone (the process's are measured by the parent). The per-request
records go to REPORT (`report_jsonl_path`, one JSON object per request, written by the mocker).
`calibrate` replays single requests on an empty engine of N blocks and prints their timings: the
time to first token of a cold prompt of one block and of one full token budget, and the
inter-token latency of each decoding alone (the mocker's decode step grows with the share of the
pool in use, so the pool is the case's).

The API, as ai-dynamo-runtime 1.6.1 defines it (dynamo/_core.pyi and the functions'
signatures): `dynamo._core.run_mocker_trace_replay(trace_files, extra_engine_args=None, …,
replay_mode="offline", arrival_speedup_ratio=1.0, trace_block_size=None,
trace_format="mooncake", report_jsonl_path=None, capture_per_request=False, …)`; offline it
returns an object whose `.summary` is a dict and whose `.per_request` is a list of dicts when
`capture_per_request` is set. `extra_engine_args` is an engine launch config whose `engine`
table is the mocker's engine (its keys are checked: an unknown one is a ValueError).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

SUMMARY_KEYS = (
    "num_requests",
    "completed_requests",
    "total_input_tokens",
    "total_output_tokens",
    "prefix_cache_reused_ratio",
    "first_admission_prefix_cache_reused_ratio",
    "kv_eviction_policy",
    "duration_ms",
    "wall_time_ms",
)


def engine_args(block_size: int, blocks: int, max_num_seqs: int, budget: int) -> dict[str, Any]:
    """The launch config: vLLM's scheduling with prefix caching and chunked prefill (the
    mocker's defaults, spelled out), `blocks` KV blocks of `block_size` tokens."""
    return {
        "engine": {
            "backend": "vllm",
            "block_size": block_size,
            "num_gpu_blocks": blocks,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": budget,
            "enable_prefix_caching": True,
            "enable_chunked_prefill": True,
        },
        "num_gpu_blocks_is_explicit": True,
    }


def replay(trace: str, args: dict[str, Any], block_size: int, **options: Any) -> Any:
    from dynamo._core import run_mocker_trace_replay

    return run_mocker_trace_replay(
        [trace],
        extra_engine_args=args,
        replay_mode="offline",
        trace_format="mooncake",
        trace_block_size=block_size,
        arrival_speedup_ratio=1.0,
        **options,
    )


def run(ns: argparse.Namespace) -> dict[str, Any]:
    args = engine_args(ns.block_size, ns.blocks, ns.max_num_seqs, ns.max_num_batched_tokens)
    cpu, wall = time.process_time(), time.perf_counter()
    result = replay(ns.trace, args, ns.block_size, report_jsonl_path=ns.report)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    summary = {k: result.summary.get(k) for k in SUMMARY_KEYS}
    return {"summary": summary, "call_cpu_s": cpu, "call_wall_s": wall}


def calibrate(ns: argparse.Namespace) -> dict[str, Any]:
    """Single requests on an empty engine of `ns.blocks` blocks: TTFT of a cold one-block prompt
    and of a cold one-budget prompt (one prefill step each), and the ITL of each decoding."""
    size, budget = ns.block_size, ns.max_num_batched_tokens
    args = engine_args(size, ns.blocks, ns.max_num_seqs, budget)
    timings: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tokens in (size, budget):
            path = os.path.join(tmp, f"one-{tokens}.jsonl")
            record = {"timestamp": 0, "input_length": tokens, "output_length": 2}
            record["hash_ids"] = list(range(-(-tokens // size)))
            with open(path, "w") as f:
                f.write(json.dumps(record) + "\n")
            (row,) = replay(path, args, size, capture_per_request=True).per_request
            timings[f"ttft_ms_{tokens}"] = row["ttft_ms"]
            timings[f"itl_ms_{tokens}"] = row["itl_ms"]
    return timings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    run_p = sub.add_parser("run", help="replay a trace")
    run_p.add_argument("trace")
    run_p.add_argument("--report", required=True, help="per-request JSON lines")
    cal_p = sub.add_parser("calibrate", help="single-request timings")
    for p in (run_p, cal_p):
        p.add_argument("--blocks", type=int, required=True, help="num_gpu_blocks")
        p.add_argument("--block-size", type=int, default=512)
        p.add_argument("--max-num-seqs", type=int, default=256)
        p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ns = ap.parse_args(argv)
    try:
        out = run(ns) if ns.mode == "run" else calibrate(ns)
    except ImportError as e:
        sys.exit(f"replay.py: dynamo is not importable ({e}): bash benchmarks/mocker/setup_venv.sh")
    except Exception as e:  # the bindings raise plain Exception, e.g. for a missing trace
        sys.exit(f"replay.py: the mocker's replay failed: {e}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
