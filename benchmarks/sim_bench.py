#!/usr/bin/env python3
"""Simulated requests per second of `kvreuse simulate`.

Workload: N requests (default 10,000) sharing one 1,024-token prefix, 2,048-token prompts, 64
output tokens each, all arriving at once, on the `attention-16` and `hybrid-dcp4` presets.
Prints one JSON object per line (`metric`, `value`, `unit`, `params`); progress on stderr.
Wall-clock time (and, in `params`, this process's CPU time, which other load on a shared
machine disturbs less) covers the whole simulation (scheduler, core and fake engine), not the
workload generation.

`--anchor` also drives vLLM's own v1 scheduler and KV cache manager through the same workload
on the `attention-16` geometry (`sim_anchor_vllm.py`, run with `.venv-vllm-anchor/bin/python`)
and prints the ratios of the two rates measured in this run.

Every record carries `params.path`, the core path that ran ("native": the C kernels, "pure":
pure Python). `--paths native,pure` runs each preset on each path in its own subprocess
(`KVREUSE_PURE=0` or `1`), alternating which goes first, and prints the ratios per path.
`--rounds N` repeats all of it N times (ours, then vLLM's, each round) and, with `--anchor`, ends
with each ratio's median over the rounds and every round's value (`params.per_round`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvreuse.core import native
from kvreuse.deployment import preset
from kvreuse.sim.generators import shared_prefix
from kvreuse.sim.run import simulate
from kvreuse.sim.workload import load_workload

HERE = Path(__file__).resolve().parent
DEFAULT_ANCHOR_PYTHON = HERE.parent / ".venv-vllm-anchor" / "bin" / "python"
PATHS = ("native", "pure")


def emit(metric: str, value: float | None, unit: str, **params: Any) -> None:
    line = {"metric": metric, "value": value, "unit": unit, "params": params}
    print(json.dumps(line), flush=True)


def run_ours(name: str, requests: int) -> float:
    """Simulate the workload on preset `name`; print its line and return requests/s (wall)."""
    lines = shared_prefix(prefix_len=1024, suffix_len=1024, requests=requests, max_tokens=64)
    workload = load_workload([json.dumps(x) for x in lines])
    print(f"simulating {requests} requests on {name} …", file=sys.stderr)
    t0, c0 = time.perf_counter(), time.process_time()
    s = simulate(preset(name), workload).summary
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    emit(
        "sim_requests_per_s",
        round(requests / wall, 1),
        "requests/s",
        preset=name,
        requests=requests,
        prompt_tokens=2048,
        shared_prefix=1024,
        max_tokens=64,
        wall_s=round(wall, 3),
        cpu_s=round(cpu, 3),  # CPU time of this process: robust to other load on the machine
        requests_per_cpu_s=round(requests / cpu, 1),
        steps=s["steps"],
        hit_rate=round(s["hit_rate"], 4),
        preemptions=s["preemptions"],
        reconciled=s["reconciled"],
        target=">= 2000",
        path=native.ACTIVE,
    )
    return requests / wall


def run_path(path: str, name: str, requests: int) -> float | None:
    """`run_ours` in a subprocess on core path `path`; its rate, or None (with a line saying
    why) when that path is not what ran."""
    env = {**os.environ, "KVREUSE_PURE": "1" if path == "pure" else "0"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--presets", name]
    proc = subprocess.run(
        [*cmd, "--requests", str(requests)], env=env, stdout=subprocess.PIPE, text=True
    )
    recs = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    rec = next((r for r in recs if r["metric"] == "sim_requests_per_s"), None)
    if proc.returncode != 0 or rec is None or rec["params"]["path"] != path:
        ran = rec["params"]["path"] if rec else None
        why = f"exit {proc.returncode}" if proc.returncode else f"the core ran on {ran!r}"
        emit("path_unavailable", None, "", path=path, preset=name, reason=why)
        return None
    print(json.dumps(rec), flush=True)
    return float(rec["value"])


def run_anchor(anchor_py: Path, requests: int) -> dict[str, Any] | None:
    """vLLM's scheduler on the same workload; its record, or None (with a line saying why)."""
    script = HERE / "sim_anchor_vllm.py"
    if not anchor_py.exists():
        emit("anchor_unavailable", None, "", reason=f"{anchor_py} does not exist")
        return None
    print(f"anchor: vLLM's scheduler, {requests} requests …", file=sys.stderr)
    proc = subprocess.run(
        [str(anchor_py), str(script), "--requests", str(requests)],
        capture_output=True,
        text=True,
        check=False,
    )
    recs = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    if proc.returncode != 0 or not recs:
        why = f"exit {proc.returncode}"
        emit("anchor_unavailable", None, "", reason=why, stderr_tail=proc.stderr[-2000:])
        return None
    print(json.dumps(recs[0]), flush=True)
    return recs[0]


def ratios(rec: dict[str, Any], ours: float) -> dict[str, float]:
    """Ours on `attention-16` over vLLM's rate: like for like (vLLM's request building, where
    it hashes a prompt, included: ours hashes inside the timed run) and vLLM's loop alone."""
    return {
        "sim_vs_vllm_ratio": ours / rec["params"]["requests_per_s_incl_request_build"],
        "sim_vs_vllm_loop_ratio": ours / rec["value"],
    }


def emit_ratios(rec: dict[str, Any], ours: float, path: str, **extra: Any) -> None:
    p = rec["params"]
    common = dict(
        ours_requests_per_s=round(ours, 1),
        vllm_requests_per_s_incl_build=p["requests_per_s_incl_request_build"],
        vllm_requests_per_s_loop_only=rec["value"],
        vllm_steps=p["steps"],
        vllm_preemptions=p["preemptions"],
        path=path,
        note="same machine, same run; ratios, not absolute rates, are comparable",
        **extra,
    )
    for metric, value in ratios(rec, ours).items():
        target = {"target": ">= 3"} if metric == "sim_vs_vllm_loop_ratio" else {}
        emit(metric, round(value, 2), "x", **target, **common)


def emit_medians(per_round: dict[str, list[dict[str, float]]]) -> None:
    """Per path, the median of each ratio over the rounds, with every round's value."""
    for path, rounds in per_round.items():
        for metric in ("sim_vs_vllm_ratio", "sim_vs_vllm_loop_ratio"):
            values = [r[metric] for r in rounds]
            extra = {"target": ">= 3"} if metric == "sim_vs_vllm_loop_ratio" else {}
            emit(
                metric,
                round(statistics.median(values), 2),
                "x",
                stat=f"median of {len(values)} rounds",
                per_round=[round(v, 3) for v in values],
                path=path,
                **extra,
            )


def run_round(args: argparse.Namespace, names: list[str], rnd: int) -> dict[str, dict[str, float]]:
    """Every preset on every path once; path -> preset -> requests/s."""
    rates: dict[str, dict[str, float]] = {}  # path -> preset -> requests/s
    if args.paths is None:
        rates[native.ACTIVE] = {name: run_ours(name, args.requests) for name in names}
        return rates
    for i, name in enumerate(names):
        order = args.paths if (i + rnd) % 2 == 0 else args.paths[::-1]  # alternate the first
        for path in order:
            rate = run_path(path, name, args.requests)
            if rate is not None:
                rates.setdefault(path, {})[name] = rate
    return rates


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--presets", default="attention-16,hybrid-dcp4")
    ap.add_argument("--anchor", action="store_true", help="also run vLLM's scheduler (ratio)")
    ap.add_argument("--anchor-python", type=Path, default=DEFAULT_ANCHOR_PYTHON)
    ap.add_argument(
        "--paths",
        help="comma list of core paths (native, pure), each preset run on each in its own "
        "subprocess; default: this process's path only",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run everything this many times, alternating ours and vLLM's; with --anchor the "
        "ratios are also given as medians over the rounds",
    )
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error(f"--requests must be ≥ 1, got {args.requests}")
    if args.rounds < 1:
        ap.error(f"--rounds must be ≥ 1, got {args.rounds}")
    names = args.presets.split(",")
    if args.paths is not None:
        args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
        paths = args.paths
        if not paths or any(p not in PATHS for p in paths) or len(set(paths)) != len(paths):
            ap.error(f"--paths: expected a comma list of {', '.join(PATHS)}, got {args.paths!r}")
    per_round: dict[str, list[dict[str, float]]] = {}  # path -> each round's ratios
    for rnd in range(args.rounds):
        if args.rounds > 1:
            print(f"round {rnd + 1} of {args.rounds}", file=sys.stderr)
        rates = run_round(args, names, rnd)
        if not args.anchor:
            continue
        rec = run_anchor(args.anchor_python, args.requests)
        if rec is None:
            break
        for path, by_preset in rates.items():
            if "attention-16" in by_preset:
                ours = by_preset["attention-16"]
                emit_ratios(rec, ours, path, round=rnd + 1)
                per_round.setdefault(path, []).append(ratios(rec, ours))
    if args.rounds > 1 and per_round:
        emit_medians(per_round)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
