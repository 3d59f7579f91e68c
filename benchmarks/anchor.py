"""Run vLLM's side of the core benchmark (the anchor) beside ours and turn both into ratios.

`run_anchor` runs `benchmarks/vllm/core_driver.py` with the interpreter of the vLLM venv that
`benchmarks/vllm/setup_venv.sh` builds, in a subprocess, so vLLM's code is only imported there;
`round_ratios` pairs its records with ours of the same round, `emit_ratios` prints one line per
ratio (median over rounds) with the targets.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ANCHOR_DIR = REPO / "benchmarks" / "vllm"  # holds DRIVER and setup_venv.sh
DEFAULT_ANCHOR_PYTHON = REPO / ".venv-vllm-anchor" / "bin" / "python"
DRIVER = "core_driver.py"
SETUP_HINT = "build it with: bash benchmarks/vllm/setup_venv.sh"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


TARGETS: dict[str, tuple[str, float]] = {
    "hash_sha256_ratio": (">=", 4.0),  # the native path's target; the pure path reports it too
    "lookup_full_hit_ratio": (">=", 10.0),
    "request_cycle_ratio": (">=", 2.0),  # and no round below CYCLE_FLOOR
    "bytes_per_cached_block_ratio": (">=", 1.5),
}
BYTES_TARGET = 176.8  # kvreuse bytes per cached block must also stay at or below this
CYCLE_FLOOR = 1.5  # no round of the request cycle ratio may fall below this


def run_anchor(
    em: Any, which: list[str], quick: bool, anchor_dir: Path, anchor_py: Path, repeat: int
) -> list[dict[str, Any]] | None:
    """Run the vLLM driver for our benches `which` (hash, lookup, cycle, memory); its records,
    or None (and one `anchor_unavailable` line) if it cannot run."""
    # absolute, because the driver runs in anchor_dir (not resolved: a venv's python is a link)
    script, anchor_py = Path(os.path.abspath(anchor_dir / DRIVER)), Path(os.path.abspath(anchor_py))
    if not anchor_py.exists() or not script.exists():
        missing = anchor_py if not anchor_py.exists() else script
        hint = SETUP_HINT if missing == anchor_py else f"--anchor-dir must hold {DRIVER}"
        em.emit("anchor_unavailable", None, "", reason=f"{missing} does not exist; {hint}")
        log(f"anchor: {missing} does not exist ({hint}); ratios skipped")
        return None
    fd, out_name = tempfile.mkstemp(prefix="vllm_anchor_", suffix=".jsonl")
    os.close(fd)
    only = ",".join(which)
    cmd = [str(anchor_py), str(script), "--only", only, "--out", out_name]
    cmd += ["--repeat", str(repeat)] + (["--quick"] if quick else [])
    log(f"anchor: running {' '.join(cmd)} in {anchor_dir}")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=anchor_dir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        recs = [json.loads(line) for line in Path(out_name).read_text().splitlines() if line]
    finally:
        Path(out_name).unlink(missing_ok=True)
    if proc.returncode != 0:
        em.emit(
            "anchor_unavailable",
            None,
            "",
            reason=f"{DRIVER} exited with {proc.returncode}",
            stderr_tail=proc.stderr[-2000:],
        )
        return None
    sys.stderr.write(proc.stderr)
    env = next((r for r in recs if r.get("bench") == "env"), None)
    em.emit(
        "anchor_run",
        round(time.perf_counter() - t0, 1),
        "s",
        impl=recs[0].get("impl") if recs else None,
        versions=env["value"] if env else None,
        only=only,
        repeat=repeat,
        quick=quick,
    )
    return recs


def _anchor_find(recs: list[dict[str, Any]], metric: str, **match: Any) -> dict[str, Any] | None:
    for r in recs:
        if r.get("metric") == metric and all(r["params"].get(k) == v for k, v in match.items()):
            return r
    return None


Ratio = tuple[str, float, dict[str, Any]]  # (metric, value, raw values)


def round_ratios(em: Any, recs: list[dict[str, Any]], rnd: int) -> list[Ratio]:
    """The ratios of one round: our records of round `rnd` against the anchor's of that round."""
    out: list[Ratio] = []
    ours = em.find("hash_tokens_per_s", algo="sha256", round=rnd)
    theirs = _anchor_find(recs, "tokens_per_s", hash_fn="sha256", block_size=16)
    if ours and theirs and ours["value"]:
        p = ours["params"]
        v_best = theirs["params"]["num_tokens"] / (theirs["params"]["min_ms"] / 1e3)
        raw = dict(
            kvreuse_tokens_per_s=p["median_tokens_per_s"],
            vllm_tokens_per_s=theirs["value"],
            ratio_best=round(ours["value"] / v_best, 3),
            kvreuse_best_tokens_per_s=ours["value"],
            vllm_best_tokens_per_s=round(v_best),
            stat="median / median (ours of 7 runs, vLLM of its --repeat)",
        )
        out.append(("hash_sha256_ratio", p["median_tokens_per_s"] / theirs["value"], raw))
    for label, metric in (("full_hit", "lookup_full_hit_ratio"), ("miss", "lookup_miss_ratio")):
        ours = em.find(f"lookup_{label}_us", round=rnd)
        theirs = _anchor_find(recs, f"get_computed_blocks_{label}_us", geometry="fa-b16")
        if ours and theirs:
            raw = dict(kvreuse_us=ours["value"], vllm_us=theirs["value"], stat="median / median")
            out.append((metric, theirs["value"] / ours["value"], raw))
    ours = em.find("request_cycle_us", events=False, round=rnd)
    theirs = _anchor_find(recs, "lookup_alloc_free_us_per_request")
    if ours and theirs:
        raw = dict(
            kvreuse_us=ours["value"],
            vllm_us=round(theirs["value"], 3),
            stat="mean per request; vLLM lookup+allocate_slots+free vs ours, events off",
        )
        out.append(("request_cycle_ratio", theirs["value"] / ours["value"], raw))
    ours = em.find("bytes_per_cached_block", round=rnd)
    theirs = _anchor_find(recs, "resident_bytes_per_cached_block")
    if ours and theirs:
        raw = dict(kvreuse_bytes=ours["value"], vllm_bytes=round(theirs["value"], 1))
        out.append(("bytes_per_cached_block_ratio", theirs["value"] / ours["value"], raw))
    return out


def emit_ratios(em: Any, per_round: list[list[Ratio]]) -> None:
    """One line per ratio: the median over rounds, with the raw values of the median round."""
    em.context = {}
    metrics = list(dict.fromkeys(m for rows in per_round for m, _, _ in rows))
    for metric in metrics:
        rows = [(v, raw) for rr in per_round for m, v, raw in rr if m == metric]
        values = [v for v, _ in rows]
        med = statistics.median(values)
        _, raw = min(rows, key=lambda r: abs(r[0] - med))  # the round nearest the median
        params: dict[str, Any] = {}
        if metric in TARGETS:
            op, target = TARGETS[metric]
            ok = med >= target
            params["target"] = f"{op} {target}"
            if metric == "bytes_per_cached_block_ratio":
                ok = ok and raw["kvreuse_bytes"] <= BYTES_TARGET
                params["target"] += f" and kvreuse_bytes <= {BYTES_TARGET}"
            if metric == "request_cycle_ratio":
                ok = ok and min(values) >= CYCLE_FLOOR
                params["target"] += f" and every round >= {CYCLE_FLOOR}"
            params["ok"] = ok
        params.update(raw)
        params.update(rounds=len(values), per_round=[round(v, 3) for v in values])
        em.emit(metric, round(med, 3), "x", **params)
