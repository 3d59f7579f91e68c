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
"""

from __future__ import annotations

import argparse
import json
import os
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


def emit_ratios(rec: dict[str, Any], ours: float, path: str) -> None:
    """Ours on `attention-16` over vLLM's rate, with and without vLLM's request building."""
    p = rec["params"]
    # vLLM hashes a prompt when its Request is built; ours hashes inside the timed run, so
    # the like-for-like rate includes vLLM's request building.
    theirs = p["requests_per_s_incl_request_build"]
    common = dict(
        ours_requests_per_s=round(ours, 1),
        vllm_requests_per_s_incl_build=theirs,
        vllm_requests_per_s_loop_only=rec["value"],
        vllm_steps=p["steps"],
        vllm_preemptions=p["preemptions"],
        path=path,
        note="same machine, same run; ratios, not absolute rates, are comparable",
    )
    emit("sim_vs_vllm_ratio", round(ours / theirs, 2), "x", **common)
    # vLLM's scheduler loop alone (its prompts hashed before the clock starts; ours inside)
    emit("sim_vs_vllm_loop_ratio", round(ours / rec["value"], 2), "x", target=">= 3", **common)


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
    args = ap.parse_args(argv)
    if args.requests < 1:
        ap.error(f"--requests must be ≥ 1, got {args.requests}")
    names = args.presets.split(",")
    rates: dict[str, dict[str, float]] = {}  # path -> preset -> requests/s
    if args.paths is None:
        rates[native.ACTIVE] = {name: run_ours(name, args.requests) for name in names}
    else:
        paths = [p.strip() for p in args.paths.split(",") if p.strip()]
        if not paths or any(p not in PATHS for p in paths) or len(set(paths)) != len(paths):
            ap.error(f"--paths: expected a comma list of {', '.join(PATHS)}, got {args.paths!r}")
        for i, name in enumerate(names):
            for path in paths if i % 2 == 0 else paths[::-1]:  # alternate which goes first
                rate = run_path(path, name, args.requests)
                if rate is not None:
                    rates.setdefault(path, {})[name] = rate
    if args.anchor:
        rec = run_anchor(args.anchor_python, args.requests)
        if rec is not None:
            for path, by_preset in rates.items():
                if "attention-16" in by_preset:
                    emit_ratios(rec, by_preset["attention-16"], path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
