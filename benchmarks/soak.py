#!/usr/bin/env python3
"""Soak test of the core: at least 10^6 random operations on a small, evicting cache, with the
manager's invariants checked as it goes. Not part of the test suite (minutes, not seconds).

    python benchmarks/soak.py                      # 1,000,000 operations, every geometry
    python benchmarks/soak.py --ops 200000 --seed 7 --json

Each operation is one call of the spec's surface: add_request (with shared prefixes, salts,
and now and then an invalid salt that must be refused without any change), lookup, allocate
(admissions in chunks, growth), seal_step, commit (or discard, whose requests go back to
waiting), finish, preempt and reset. `check_invariants()` runs every `--check-every`
operations and at the end; lookups are checked to be pure (the epoch does not move) and to
reuse less than the whole prompt. Exit status 1 on the first violation, with the seed and the
operation count to replay it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from kvreuse.core import KVCacheManager, Request
from kvreuse.deployment import preset

GEOMETRIES = ("tiny-hybrid-dcp4", "tiny-sliding-hybrid", "tiny-attention", "hybrid-dcp4")
SALTS = (None, None, "tenant-a", "tenant-é", "")
BAD_SALT = "tenant-\ud800"


@dataclass
class Req:
    tokens: list[int]
    max_tokens: int
    running: bool = False
    committed: int = 0


@dataclass
class Soak:
    mgr: KVCacheManager
    rng: random.Random
    unit: int
    reqs: dict[str, Req] = field(default_factory=dict)
    ops: int = 0
    next_id: int = 0
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str, n: int = 1) -> None:
        self.ops += n
        self.counts[what] = self.counts.get(what, 0) + n

    def add(self) -> None:
        rng, u = self.rng, self.unit
        prefix = [7 + rng.randrange(4)] * (u * rng.randrange(1, 9))  # shared prefixes
        tokens = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 3 * u))]
        rid = f"r{self.next_id}"
        self.next_id += 1
        if rng.random() < 0.01:  # an invalid salt is refused and changes nothing
            epoch = self.mgr.epoch
            try:
                self.mgr.add_request(Request(rid, tokens, cache_salt=BAD_SALT))
            except ValueError:
                pass
            else:
                raise AssertionError("a lone-surrogate salt was accepted")
            assert self.mgr.epoch == epoch and rid not in self.mgr.requests
            self.count("add_refused")
            return
        self.mgr.add_request(Request(rid, tokens, cache_salt=rng.choice(SALTS)))
        self.reqs[rid] = Req(tokens, rng.randrange(1, 8))
        self.count("add")

    def step(self) -> None:
        rng, mgr = self.rng, self.mgr
        planned: list[str] = []
        for rid in rng.sample(sorted(self.reqs), min(len(self.reqs), rng.randrange(1, 6))):
            r = self.reqs[rid]
            chunk = rng.choice((1, self.unit, 4 * self.unit, 10**9))
            if r.running:
                plan = mgr.allocate(rid, min(chunk, len(r.tokens) - r.committed))
                self.count("grow")
            else:
                epoch = mgr.epoch
                res = mgr.lookup(rid)
                assert mgr.epoch == epoch and 0 <= res.hit < len(r.tokens), (rid, res.hit)
                plan = mgr.allocate(rid, min(chunk, len(r.tokens) - res.hit), lookup=res)
                self.count("lookup+admit", 2)
                if plan is not None:
                    r.running, r.committed = True, res.hit
            if plan is not None:
                planned.append(rid)
        step = mgr.seal_step()
        self.count("seal")
        if not step.requests:
            return
        if rng.random() < 0.03:
            mgr.discard(step.step_id)  # its requests go back to waiting
            for rid in planned:
                self.reqs[rid].running = False
            self.count("discard")
            return
        mgr.commit(step.step_id, self._outcomes(step))
        self.count("commit")

    def _outcomes(self, step: Any) -> dict[str, tuple[int, list[int], list[int]]]:
        out = {}
        for plan in step.requests:
            r = self.reqs[plan.request_id]
            end = plan.start + plan.num_new_tokens
            new = [self.rng.randrange(50)] if end == len(r.tokens) else []
            out[plan.request_id] = (end, new, [s.position for s in plan.saves])
            r.committed = end
            r.tokens.extend(new)
            r.max_tokens -= len(new)
        return out

    def finish_or_preempt(self) -> None:
        done = [rid for rid, r in self.reqs.items() if r.max_tokens <= 0]
        for rid in done:
            self.mgr.finish(rid)
            del self.reqs[rid]
            self.count("finish")
        if not self.reqs:
            return
        rid = self.rng.choice(sorted(self.reqs))
        r = self.reqs[rid]
        if r.running and self.rng.random() < 0.5:
            self.mgr.preempt(rid)
            r.running = False
            self.count("preempt")
        elif self.rng.random() < 0.3:
            self.mgr.finish(rid)
            del self.reqs[rid]
            self.count("abort")


def soak(geometry: str, num_ops: int, seed: int, check_every: int) -> dict[str, Any]:
    dep = preset(geometry)
    cfg = replace(dep.cache, num_blocks=48)  # small: admissions fail, blocks are evicted
    mgr = KVCacheManager(cfg)
    s = Soak(mgr, random.Random(seed), mgr.geo.hash_unit)
    checks, next_check, t0 = 0, check_every, time.perf_counter()
    while s.ops < num_ops:
        roll = s.rng.random()
        if roll < 0.25 and len(s.reqs) < 12:
            s.add()
        elif roll < 0.85:
            s.step()
        elif roll < 0.995:
            s.finish_or_preempt()
        else:
            s.mgr.reset()  # refused while blocks are in use
            s.count("reset")
        if s.ops >= next_check:
            s.mgr.check_invariants()
            checks += 1
            next_check += check_every
    s.mgr.check_invariants()
    m = s.mgr.metrics()
    assert m["prefix_cache_hits"] <= m["prefix_cache_queries"]
    seconds = time.perf_counter() - t0
    return {
        "geometry": geometry,
        "ops": s.ops,
        "seconds": round(seconds, 2),
        "ops_per_s": round(s.ops / seconds),
        "invariant_checks": checks + 1,
        "hits": m["prefix_cache_hits"],
        "evicted": m.get("kv_blocks_evicted_total", 0),
        "by_op": s.counts,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=1_000_000, help="operations per geometry")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-every", type=int, default=2000)
    ap.add_argument("--geometry", action="append", help="preset(s) (default: four)")
    ap.add_argument("--json", action="store_true", help="one JSON object per geometry")
    args = ap.parse_args(argv)
    for name in args.geometry or GEOMETRIES:
        try:
            row = soak(name, args.ops, args.seed, args.check_every)
        except Exception as exc:
            print(f"soak {name} seed {args.seed}: FAILED: {type(exc).__name__}: {exc}")
            return 1
        if args.json:
            print(json.dumps(row), flush=True)
        else:
            print(
                f"{name}: {row['ops']:,} operations in {row['seconds']} s "
                f"({row['ops_per_s']:,}/s), {row['invariant_checks']} invariant checks, "
                f"{row['hits']:,} tokens hit, {row['evicted']:,} blocks evicted: ok",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
