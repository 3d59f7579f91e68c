"""Tier ops that fail are misses: `KVCacheManager.tier_faults` against a model of the bytes.

Random sessions of prompts (resends, extensions, divergences) run one request at a time on a
small pool with a host tier and a store tier below it, so pages go down and come back. An
engine carries out each step's tier ops on a model of the bytes (a device block or tier slot
holds the set of (group, key) entries written into it) and fails each op at random, as a store
that is down, reset or lying would: a failed write leaves its slot without the bytes, a failed
read copies nothing. It reports what failed to the core, which forgets those slots and sends a
request whose load failed back to wait. After every step:

- `check_invariants()` holds, and no slot reported bad is still indexed under its keys;
- every admission that runs reads, in every page of its hit, bytes written for its own
  prefix (a failed load is never read), and a loaded block is published only with keys whose
  bytes the load brought;
- the hit counters count only admissions that ran: at the end, the first hits of the finished
  requests add up to `prefix_cache_hits`, and the tiers' hit tokens to at most that.
"""

from __future__ import annotations

import random
from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.core import Demote, Load, Move, TierSpec

Entry = tuple[int, bytes]  # (group id, key)


class FaultyEngine:
    """Runs a step's tier ops on the byte model, failing each with probability `p`. A slot
    keeps the identity (group, keys) of the op that wrote it beside its bytes, and a read
    whose op names another identity fails too, as the engine's identity check does."""

    def __init__(self, mgr: KVCacheManager, rng: random.Random, p: float) -> None:
        self.mgr, self.rng, self.p = mgr, rng, p
        self.dev: defaultdict[int, set[Entry]] = defaultdict(set)
        self.slots: dict[tuple[int, int], tuple[object, set[Entry]]] = {}
        self.loaded: dict[int, set[Entry]] = {}  # device block -> what its load brought
        self.num_faults = 0

    def read(self, where: tuple[int, int], ident: object) -> set[Entry] | None:
        held = self.slots.get(where)
        if self.rng.random() < self.p or held is None or held[0] != ident:
            return None
        return set(held[1])

    def run(self, ops: list) -> list[str]:
        bad: list[tuple[int, int, int, list[tuple[int, bytes]]]] = []
        blocks: list[int] = []
        for op in ops:
            ident = (op.group_id, tuple(op.keys))
            if isinstance(op, Demote):
                if self.rng.random() < self.p:  # the write never landed
                    self.slots.pop((op.tier, op.slot), None)
                    bad.append((op.tier, op.slot, op.group_id, list(op.keys)))
                else:
                    self.slots[op.tier, op.slot] = (ident, set(self.dev[op.block_id]))
            elif isinstance(op, Move):
                got = self.read((op.src_tier, op.src_slot), ident)
                if got is None:
                    self.slots.pop((op.dst_tier, op.dst_slot), None)
                    bad.append((op.src_tier, op.src_slot, op.group_id, list(op.keys)))
                    bad.append((op.dst_tier, op.dst_slot, op.group_id, list(op.keys)))
                else:
                    self.slots[op.dst_tier, op.dst_slot] = (ident, got)
            else:
                assert isinstance(op, Load)
                got = self.read((op.tier, op.slot), ident)
                self.dev[op.block_id] = self.loaded[op.block_id] = got or set()
                if got is None:
                    bad.append((op.tier, op.slot, op.group_id, list(op.keys)))
                    blocks.append(op.block_id)
        self.num_faults += len(bad)
        failed = self.mgr.tier_faults(bad, blocks) if bad else []
        for t, slot, gid, keys in bad:  # forgotten: none of its keys still names it
            tier = self.mgr.tiers.tiers[t]
            entry = tier.slots.get(slot)
            assert entry is None or entry.keys != keys or entry.group_id != gid
        return failed


def run_request(
    mgr: KVCacheManager, eng: FaultyEngine, rid: str, tokens: list[int], page: int
) -> int:
    """One request to completion; returns the hit of the admission that ran."""
    mgr.add_request(Request(rid, tokens))
    for _ in range(50):  # each failure forgets the slots it read: it cannot go on for ever
        res = mgr.lookup(rid)
        assert mgr.allocate(rid, len(tokens) - res.hit, lookup=res) is not None
        step = mgr.seal_step()
        failed = eng.run(step.tier_ops)
        mgr.check_invariants()
        if rid in failed:
            mgr.commit(step.step_id, {})  # nothing of it runs or is published
            mgr.check_invariants()
            continue
        table = step.requests[0].tables[0]
        for j in range(res.hit // page):  # every page of the hit holds its own prefix's bytes
            key = mgr.requests[rid].chain.hashes[(j + 1) * page // mgr.geo.hash_unit]
            assert (0, key) in eng.dev[table[j]], (rid, j)
        for blk in step.requests[0].new_blocks.get(0, []):
            eng.dev[blk] = set()
            eng.loaded.pop(blk, None)
        before = {(g, bytes(k), b) for g, _, k, _, b in mgr.export_entries()}
        mgr.commit(step.step_id, {rid: (len(tokens), [7])})
        for gid, _, key, _, blk in mgr.export_entries():
            if (gid, bytes(key), blk) in before:
                continue
            if blk in eng.loaded:  # published on a loaded block: the load brought those bytes
                assert (gid, bytes(key)) in eng.loaded[blk], (rid, blk)
            else:
                eng.dev[blk].add((gid, bytes(key)))
        mgr.finish(rid)
        mgr.check_invariants()
        return res.hit
    raise AssertionError(f"{rid} never ran")


PROMPTS = st.lists(st.integers(0, 3), min_size=1, max_size=30)


@settings(deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    p=st.sampled_from([0.0, 0.2, 0.5, 1.0]),
    rounds=st.integers(1, 25),
)
def test_failed_tier_ops_are_misses_and_never_read(seed: int, p: float, rounds: int) -> None:
    rng = random.Random(seed)
    page = 4
    cfg = CacheConfig(num_blocks=10, groups=[GroupSpec(kind="full", block_size=page)])
    mgr = KVCacheManager(cfg, tiers=[TierSpec("host", 3), TierSpec("store", 12)])
    eng = FaultyEngine(mgr, rng, p)
    done: list[list[int]] = []
    hits = 0
    for i in range(rounds):
        if done and rng.random() < 0.7:
            base = rng.choice(done)
            cut = rng.randint(0, len(base))
            tokens = (base[:cut] + [rng.randrange(4) for _ in range(rng.randint(1, 10))])[:30]
        else:
            tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        hits += run_request(mgr, eng, f"r{i}", tokens, page)
        done.append(tokens)
    metrics = mgr.metrics()
    assert metrics["prefix_cache_hits"] == hits
    assert sum(t["hit_tokens"] for t in metrics["tiers"].values()) <= hits
    faulty = sum(t["faulty_blocks"] for t in metrics["tiers"].values())
    assert faulty <= eng.num_faults


def test_the_property_fails_loads() -> None:
    """The histories above do fail loads that would have hit, and recover from them."""
    page, retried = 4, 0
    for seed in range(10):
        cfg = CacheConfig(num_blocks=10, groups=[GroupSpec(kind="full", block_size=page)])
        mgr = KVCacheManager(cfg, tiers=[TierSpec("host", 3), TierSpec("store", 12)])
        eng = FaultyEngine(mgr, random.Random(seed), 0.5)
        prompt = list(range(17))
        run_request(mgr, eng, "a", prompt, page)
        for i in range(3):
            run_request(mgr, eng, f"flood{i}", [10 + i] * 17, page)
        before = mgr.metrics()["prefix_cache_preempted_requests"]
        run_request(mgr, eng, "b", prompt, page)
        retried += mgr.requests.get("b") is None and eng.num_faults > 0
        assert mgr.metrics()["prefix_cache_preempted_requests"] == before  # never counted
    assert retried
