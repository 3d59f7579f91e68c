#!/usr/bin/env python3
"""How far NVIDIA Dynamo's standalone KV indexer, unmodified, mispredicts a hybrid kvreuse
replica, with the replica publishing in `groups` mode (every group; Dynamo indexes only the
full-attention one) and in `routable` mode (the attention group, filtered to what the whole
model can reuse).

For each geometry, recurrent retention (sparse: states at save points; dense: a state at every
recurrent page) and pool (the preset's, and a tight one that evicts), a live `kvreuse serve`
replica (a scripted engine reporting every save the core planned) runs an agent workload and a
shared-prefix workload one request at a time. Before each request Dynamo's `longest_matched`
(capped at the last unit boundary before the prompt's end, as the replica always computes the
last token) is compared with the cached tokens the replica then reports: error = prediction −
cached (positive: Dynamo over-predicts, negative: it misses reuse).

Output (stdout), one JSON object per line (metric, value, unit, params, impl):
  dynamo_prediction_error_tokens   value = mean |error| per request; params: mean (signed),
                                   worst_over (largest error), worst_under (smallest),
                                   num_exact, num_requests, cached_tokens (Σ), geometry,
                                   retention, num_blocks, mode
  routable_vs_groups               value = groups' mean |error| − routable's (> 0: routable is
                                   better); params: verdict ("better", "equal", "worse") and
                                   dense_exact (routable exact where every hash unit can hold a
                                   state: dense retention with recurrent pages of one unit;
                                   null elsewhere)

Exit status 1 when routable is worse than groups anywhere, or not exact where dense_exact applies.
Needs `.venv-dynamo` (bash benchmarks/dynamo/setup_venv.sh) and the server extra.
Usage: .venv/bin/python benchmarks/dynamo_prediction.py [--quick] [--geometries a,b]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "dynamo"))

from dynamo_live import DYNAMO_PYTHON, SETUP, Row, dynamo_following, dynamo_rows, scripted_backend

import kvreuse
from kvreuse.deployment import Deployment, resolve
from kvreuse.sim.generators import agent, shared_prefix

IMPL = f"kvreuse-{kvreuse.__version__}"
MODES = ("groups", "routable")


def emit(metric: str, value: float, unit: str, **params: Any) -> None:
    record = {"metric": metric, "value": value, "unit": unit, "params": params, "impl": IMPL}
    print(json.dumps(record), flush=True)


TURNS = 6


def workload(unit: int, quick: bool) -> list[dict[str, Any]]:
    """Sized in hash units (at least 64 tokens), so that prompts span several units and pages
    on every geometry."""
    unit = max(unit, 64)
    turns, requests = (4, 5) if quick else (TURNS, 8)
    return agent(
        sessions=2, turns=turns, user_len=3 * unit + 5, tool_len=2 * unit + 3, max_tokens=8, seed=5
    ) + shared_prefix(
        prefix_len=6 * unit + 7, suffix_len=2 * unit + 1, requests=requests, max_tokens=8, seed=6
    )


def tight_pool(dep: Deployment) -> int:
    """Blocks for about three of the workload's longest requests: the cache evicts, and states
    and attention pages leave it in different orders."""
    u = max(dep.cache.geometry.hash_unit, 64)
    longest = TURNS * (5 * u + 16) + 16
    return 3 * dep.cache.blocks_for_request(longest) + 1


def cases(names: list[str], quick: bool) -> list[tuple[str, Deployment]]:
    """(retention, deployment) per geometry and retention: the preset's pool, and a tight one."""
    out = []
    for name in names:
        dep = resolve(name)
        for retention in ("sparse", "dense"):
            for blocks in (dep.cache.num_blocks, tight_pool(dep))[: 1 if quick else 2]:
                cache = replace(dep.cache, recurrent_retention=retention, num_blocks=blocks)
                out.append((retention, replace(dep, cache=cache)))
    return out


def measure(dep: Deployment, mode: str, lines: list[dict[str, Any]]) -> list[Row]:
    with dynamo_following(scripted_backend(dep), mode) as (replica, indexer):
        return list(dynamo_rows(replica, indexer, lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests, preset pools only")
    ap.add_argument(
        "--geometries",
        default="hybrid-dcp4,sliding-hybrid,tiny-hybrid-dcp4,tiny-sliding-hybrid",
        help="comma-separated presets",
    )
    args = ap.parse_args()
    if not DYNAMO_PYTHON.exists():
        print(
            f"dynamo_prediction: Dynamo's venv is absent: build it with `{SETUP}`", file=sys.stderr
        )
        return 2
    ok = True
    for retention, dep in cases(args.geometries.split(","), args.quick):
        lines = workload(dep.cache.geometry.hash_unit, args.quick)
        mae = {mode: report(dep, retention, mode, measure(dep, mode, lines)) for mode in MODES}
        gain = mae["groups"] - mae["routable"]
        verdict = "better" if gain > 0 else "equal" if gain == 0 else "worse"
        dense_exact = None
        if retention == "dense" and unit_states(dep):
            dense_exact = mae["routable"] == 0
        ok = ok and verdict != "worse" and dense_exact is not False
        emit(
            "routable_vs_groups",
            round(gain, 2),
            "tokens",
            geometry=dep.name,
            retention=retention,
            num_blocks=dep.cache.num_blocks,
            verdict=verdict,
            dense_exact=dense_exact,
        )
    return 0 if ok else 1


def unit_states(dep: Deployment) -> bool:
    """Whether a recurrent state can sit at every hash unit (recurrent pages of one unit)."""
    geo = dep.cache.geometry
    return all(g.page_size == geo.hash_unit for g in geo.groups if g.kind == "recurrent")


def report(dep: Deployment, retention: str, mode: str, rows: list[Row]) -> float:
    """Emits one mode's errors; returns its mean |error|."""
    errors = [r.predicted - r.cached for r in rows]
    mae = statistics.fmean(abs(e) for e in errors)
    emit(
        "dynamo_prediction_error_tokens",
        round(mae, 2),
        "tokens",
        geometry=dep.name,
        retention=retention,
        num_blocks=dep.cache.num_blocks,
        mode=mode,
        mean=round(statistics.fmean(errors), 2),
        worst_over=max(errors),
        worst_under=min(errors),
        num_exact=errors.count(0),
        num_requests=len(rows),
        cached_tokens=sum(r.cached for r in rows),
    )
    return mae


if __name__ == "__main__":
    raise SystemExit(main())
