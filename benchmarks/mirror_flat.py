#!/usr/bin/env python3
"""Does an event batch cost the router's mirror the same late in a run as early?

One replica's pool (full attention, 16-token blocks, `--blocks` of them) serves requests that
share a short prefix and carry a fresh tail, in waves of 8, until it has stored `--turnover`
times its capacity in blocks, so the mirror sees as many removals as stores and its memos of
removed boundaries fill and evict. After each wave the manager's events are converted
(`Converter.convert`, the live path's conversion) and applied to the replica's mirror in a
`Router` (`Router.apply`: the mirror and the router's index of which replicas hold each key,
`kvreuse.events.holders`); the CPU time of convert + apply is one batch's cost.

Prints one JSON line: the median batch cost (µs) in each tenth of the run, the ratio of the last
tenth to the middle one and to the first (flat is 1.0), and the blocks stored per capacity. The
first tenths are cheaper by construction: while the pool fills there are no removals, and until
about twice the pool's blocks have been removed the mirror's memos of removed boundaries (bounded
by the geometry's ghost capacity) are still filling; from then on every batch does the same work
on structures of the same size:

    python benchmarks/mirror_flat.py [--blocks 4096] [--turnover 10]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from kvreuse.core import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.events import Converter
from kvreuse.events.wire import BlockStored
from kvreuse.fleet.routing.router import Router

BLOCK, PROMPT, PREFIX, WAVE = 16, 512, 128, 8


def run(num_blocks: int, turnover: int) -> dict[str, float]:
    cfg = CacheConfig(
        num_blocks=num_blocks,
        groups=[GroupSpec(kind="full", block_size=BLOCK)],
        enable_events=True,
    )
    mgr = KVCacheManager(cfg)
    converter, router = Converter(mgr.geo), Router(cfg, "exact")
    router.add_replica("r0")
    rng = random.Random(7)
    prefix = [rng.randrange(32000) for _ in range(PREFIX)]
    costs: list[int] = []
    stored, i, full_at = 0, 0, -1
    gc.collect()
    while stored < turnover * num_blocks:
        live = []
        for _ in range(WAVE):
            rid = f"q{i}"
            i += 1
            toks = prefix + [rng.randrange(32000) for _ in range(PROMPT - PREFIX)]
            mgr.add_request(Request(rid, toks))
            res = mgr.lookup(rid)
            mgr.allocate(rid, PROMPT - res.hit, lookup=res)
            step = mgr.seal_step()
            mgr.commit(step.step_id, {rid: (PROMPT, [0])})
            live.append(rid)
        for rid in live:
            mgr.finish(rid)
        raw = mgr.take_events()
        c0 = time.thread_time_ns()
        events = converter.convert(raw)
        router.apply(0, events)
        costs.append(time.thread_time_ns() - c0)
        stored += sum(len(ev.block_hashes) for ev in events if isinstance(ev, BlockStored))
        if full_at < 0 and stored >= num_blocks:
            full_at = len(costs)
    tenth = max(1, len(costs) // 10)
    tenths = [statistics.median(costs[k * tenth : (k + 1) * tenth]) / 1e3 for k in range(10)]
    return {
        "batches": len(costs),
        "batches_before_full": full_at,
        "stored_per_capacity": round(stored / num_blocks, 2),
        "tenths_us": [round(t, 1) for t in tenths],
        "ratio_last_middle": round(tenths[-1] / tenths[4], 3),
        "ratio_last_first": round(tenths[-1] / tenths[0], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=4096, help="pool size in blocks")
    ap.add_argument("--turnover", type=int, default=10, help="stored blocks per capacity")
    args = ap.parse_args()
    if args.blocks < 64 or args.turnover < 1:
        raise SystemExit("mirror_flat: --blocks must be at least 64 and --turnover at least 1")
    row = run(args.blocks, args.turnover)
    print(json.dumps({"metric": "event_batch_cpu_us", "blocks": args.blocks, **row}))


if __name__ == "__main__":
    main()
