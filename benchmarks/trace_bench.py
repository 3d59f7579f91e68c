#!/usr/bin/env python3
"""A public trace end to end: `kvreuse workload import`, then `kvreuse simulate`, timed.

    .venv/bin/python benchmarks/trace_bench.py TRACE.jsonl [--format mooncake]
        [--geometry attention-16] [--capacity-tokens N | --capacity-tokens all] [--profile FILE]

Each command runs as a child process, as a user runs it (`simulate --no-compare --no-plots
--quiet --json`); the benchmark reports its wall time, its CPU time and its peak resident set
(ru_maxrss of the child), and the run's hit rate. `--capacity-tokens all` (the default) sizes
the pool for every page of every request (prompt and output), so an attention-only geometry
never evicts: the trace's own reuse. `--profile FILE` runs the simulation under
cProfile and writes its statistics to FILE (read them with `python -m pstats FILE`); the
times then include the profiler's overhead. Prints one JSON object per line (`metric`,
`value`, `unit`, `params`); progress on stderr. The traces are not in the repository: give the
path of one (Mooncake's FAST'25 traces: github.com/kvcache-ai/Mooncake, FAST25-release/traces).
"""

from __future__ import annotations

import argparse
import json
import os
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


def run_child(cmd: list[str], stdout: Any) -> tuple[float, float, float, str]:
    """Run `cmd`; its wall seconds, CPU seconds, peak RSS in MiB, and its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read().decode("utf-8", "replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode not in (0, 1):  # 1: the run finished but named a problem
        sys.exit(f"trace_bench: {' '.join(cmd[2:5])} failed ({proc.returncode}): {err.strip()}")
    # Linux reports ru_maxrss in KiB
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, err


def workload_tokens(path: Path, geometry: str) -> tuple[int, int, int, int | None]:
    """Requests and prompt tokens of an imported workload; the blocks that hold all of it on
    `geometry` (every request's pages for its prompt and output, summed, plus the null block:
    an upper bound that never evicts on an attention-only geometry); and the tokens a prefix
    cache with room for everything reuses by the trace's ids (`trace_reuse`)."""
    from kvreuse.deployment import resolve

    cache = resolve(geometry).cache
    pages = [g.page_size for g in cache.geometry.groups]
    page = pages[0] if len(pages) == 1 and cache.groups[0].kind == "full" else None
    known: dict[int, int] = {}  # chain of ids so far → tokens of its last block seen
    requests = prompt = blocks = reuse = 0
    with path.open() as f:
        for line in f:
            obj = json.loads(line)
            length = _length(obj["prompt"])
            requests += 1
            prompt += length
            blocks += cache.blocks_for_request(length + obj["max_tokens"])
            if page is not None:
                shared = trace_reuse(obj["prompt"], known)
                reuse += min(shared, length - 1) // page * page
    return requests, prompt, 1 + blocks, reuse if page is not None else None


def trace_reuse(prompt: dict[str, Any], known: dict[int, int]) -> int:
    """Tokens of `prompt` that earlier prompts held, by the trace's ids: the longest run of
    leading ids seen before, within what was seen of each block; then record this prompt.
    The ids are keyed by their chain (every id before them), so the count holds for traces
    whose ids name one block's content (Bailian) as for chained ones (Mooncake)."""
    first = prompt["concat"][0] if "concat" in prompt else prompt
    if "blocks" not in first:
        return 0
    blocks = first["blocks"]
    size, length = blocks["block_tokens"], blocks["len"]
    shared, chain, matching = 0, 0, True
    for k, block_id in enumerate(blocks["ids"]):
        chain = hash((chain, block_id))
        need = min(size, length - k * size)
        have = known.get(chain, 0)
        if matching:
            shared += min(have, need)
            matching = have >= need
        known[chain] = max(have, need)
    return shared


def _length(prompt: dict[str, Any]) -> int:
    kind, value = next(iter(prompt.items()))
    if kind == "concat":
        return sum(_length(p) for p in value)
    return int(value["len"])


def simulate_command(
    args: argparse.Namespace, workload: Path, out: Path, pool: list[str]
) -> list[str]:
    """`kvreuse simulate` as a user runs it on a trace (under cProfile with --profile)."""
    geometry = ["--geometry", args.geometry] if "." not in args.geometry else [args.geometry]
    sim = ["simulate", *geometry, str(workload), "--out", str(out), *pool]
    sim += ["--no-compare", "--no-plots", "--quiet", "--json"]
    if args.profile:
        return [sys.executable, "-m", "cProfile", "-o", str(args.profile), "-m", "kvreuse", *sim]
    return [*KVREUSE, *sim]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="the trace (JSON lines)")
    ap.add_argument("--format", default="mooncake", choices=("mooncake", "bailian"))
    ap.add_argument("--geometry", default="attention-16", help="preset or geometry file")
    ap.add_argument("--capacity-tokens", default="all", help="the pool, in tokens, or 'all'")
    ap.add_argument("--limit", type=int, default=None, help="import at most N requests")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile statistics to FILE")
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "workload.jsonl"
        cmd = [*KVREUSE, "workload", "import", args.format, str(args.trace)]
        cmd += ["--limit", str(args.limit)] if args.limit else []
        print(f"importing {args.trace} …", file=sys.stderr)
        with workload.open("w") as out:
            wall, cpu, rss, _ = run_child(cmd, out)
        requests, prompt, all_blocks, reuse = workload_tokens(workload, args.geometry)
        trace = {"trace": args.trace.name, "requests": requests, "prompt_tokens": prompt}
        emit(
            "import_wall_s", round(wall, 2), "s", cpu_s=round(cpu, 2), peak_mib=round(rss), **trace
        )
        if args.capacity_tokens == "all":
            pool = ["--num-blocks", str(all_blocks)]
        else:
            pool = ["--capacity-tokens", args.capacity_tokens]
        cmd = simulate_command(args, workload, Path(tmp) / "out", pool)
        print(f"simulating on {args.geometry} ({' '.join(pool)}) …", file=sys.stderr)
        summary_path = Path(tmp) / "summary.out"
        with summary_path.open("w") as out:
            wall, cpu, rss, _ = run_child(cmd, out)
        summary = json.loads(summary_path.read_text())
    emit(
        "simulate_wall_s",
        round(wall, 2),
        "s",
        cpu_s=round(cpu, 2),
        peak_mib=round(rss),
        geometry=args.geometry,
        capacity_tokens=summary["capacity_tokens"],
        hit_rate=round(summary["hit_rate"], 4),
        hits=summary["hits"],
        trace_reuse=reuse,  # by the ids, with room for everything: equals hits then
        queries=summary["queries"],
        evicted_blocks=summary["evicted_blocks"],
        preemptions=summary["preemptions"],
        steps=summary["steps"],
        reconciled=summary["reconciled"],
        profiled=args.profile is not None,
        **trace,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
