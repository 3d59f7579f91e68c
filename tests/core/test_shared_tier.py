"""A tier several managers share (kvreuse.core.tiers.shared): random histories on two or three
replicas that take their steps in turn over one store, each checked as a lone replica with
tiers is (test_tiers.py): every lookup against the oracle over its pool, its own tiers and the
store; a model of the bytes carried by every replica's ops through one set of store slots; the
mirror of each replica, reading the store through one StoreMirror, key for key."""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import Engine
from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.core import (
    Admission,
    ConfigError,
    Demote,
    InvariantError,
    Load,
    SharedTier,
    SharedTierBusyError,
    StaleLookupError,
    TierSpec,
)
from kvreuse.events import StoreMirror
from kvreuse.fleet.serving.store import StoreFollower
from kvreuse.serve.store_view import decode, encode
from test_properties import geometries
from test_tiers import TierDriver


class FleetEngine(Engine):
    """The harness's histories, with prompts drawn from every replica's requests: a session
    started on one replica goes on, or is resent, on another."""

    def __init__(self, drv: TierDriver, max_len: int, peers: list[TierDriver]) -> None:
        super().__init__(drv, max_len)
        self.peers = peers

    def random_prompt(self) -> list[int]:
        mine = self.drv.finished, self.drv.known
        other = self.rng.choice(self.peers)
        self.drv.finished = other.finished + self.drv.finished
        self.drv.known = {**other.known, **self.drv.known}
        try:
            return super().random_prompt()
        finally:
            self.drv.finished, self.drv.known = mine

    def run(self, num_rounds: int) -> None:
        """A turn: the history's steps, then a step that takes the ops decided after the last
        one (a chaos eviction's demotes) and runs them, before another replica decides."""
        super().run(num_rounds)
        step = self.drv.mgr.seal_step()
        assert not step.requests
        self.drv.trace.append(step)
        self.drv.check()


def fleet(
    cfg: CacheConfig,
    seed: int,
    num_replicas: int,
    store_blocks: int,
    host_blocks: int | None,
    admission: Admission = Admission.ON_EVICTION,
) -> tuple[list[TierDriver], SharedTier, StoreMirror]:
    spec = TierSpec("store", store_blocks, default=admission)
    store = SharedTier(spec, cfg, enable_events=True)
    mirror = StoreMirror(cfg.geometry, store.spec.medium)
    slot_bytes: defaultdict[tuple[Any, int, int], set[Any]] = defaultdict(set)
    rng = random.Random(seed)
    drivers = []
    for _ in range(num_replicas):
        tiers: list[TierSpec | SharedTier] = [store]
        if host_blocks is not None:
            tiers.insert(0, TierSpec("host", host_blocks, medium="CPU"))
        drivers.append(TierDriver(cfg, rng, tiers, store=mirror, slot_bytes=slot_bytes))
    for drv in drivers[1:]:
        drv.book = drivers[0].book  # one hash function: one map of keys to prefixes
    return drivers, store, mirror


@given(
    cfg=geometries(),
    seed=st.integers(0, 2**32 - 1),
    num_replicas=st.integers(2, 3),
    store_blocks=st.sampled_from([1, 4, 12, 40]),
    host_blocks=st.sampled_from([None, None, 2, 8]),
    admission=st.sampled_from([Admission.ON_EVICTION, Admission.WRITE_THROUGH]),
    rounds=st.integers(1, 40),
)
def test_replicas_sharing_a_store_agree_with_the_oracle(
    cfg: CacheConfig,
    seed: int,
    num_replicas: int,
    store_blocks: int,
    host_blocks: int | None,
    admission: Admission,
    rounds: int,
) -> None:
    drivers, store, mirror = fleet(cfg, seed, num_replicas, store_blocks, host_blocks, admission)
    store.record()  # and a copy, as another process holds one, kept equal by the journal
    copy = SharedTier(store.spec, cfg)
    # and a router's view, read from the same journal (its JSON) as a fleet's front reads it
    follower = StoreFollower(None, "", StoreMirror(cfg.geometry, store.spec.medium))
    page = max(g.page_size for g in cfg.geometry.groups)
    max_len = min(3 * page + 5, 120)
    engines = [FleetEngine(d, max_len, drivers) for d in drivers]
    rng = random.Random(seed ^ 0x5EED)
    for _ in range(rounds):
        rng.choice(engines).run(1)  # one replica's step at a time (the sharing rule)
        journal = store.take_journal()
        copy.replay(journal)
        assert_same_tier(copy, store)
        follower.apply(decode(encode(journal)))
        assert [i.entries for i in follower.mirror.index] == [i.entries for i in mirror.index]
    for drv in drivers:
        drv.check()
    assert not store.pinned


def assert_same_tier(a: SharedTier, b: SharedTier) -> None:
    """Slot for slot, key for key, in the same LRU order and with the same free slots."""
    assert {s: (e.group_id, e.keys) for s, e in a.slots.items()} == {
        s: (e.group_id, e.keys) for s, e in b.slots.items()
    }
    assert a.index == b.index and list(a.order) == list(b.order) and a._free == b._free


def test_the_property_loads_from_the_store_across_replicas() -> None:
    """The histories above do move bytes between replicas: a block one replica demoted is
    loaded by another, and the admission reads bytes of its own prefix."""
    cfg = CacheConfig(
        num_blocks=8, groups=[GroupSpec(kind="full", block_size=2)], enable_events=True
    )
    crossed = 0
    for seed in range(30):
        drivers, _, _ = fleet(cfg, seed, 2, 40, None)
        engines = [FleetEngine(d, 12, drivers) for d in drivers]
        rng = random.Random(seed)
        writers: dict[int, int] = {}  # store slot: the replica that last wrote it
        for _ in range(40):
            i = rng.randrange(2)
            seen = len(drivers[i].trace)
            engines[i].run(1)
            for item in drivers[i].trace[seen:]:
                for op in getattr(item, "tier_ops", ()):
                    if isinstance(op, Load):
                        crossed += writers.get(op.slot, i) != i
                    else:
                        writers[getattr(op, "slot", getattr(op, "dst_slot", -1))] = i
        for drv in drivers:
            drv.check()
    assert crossed > 20


def run_one(mgr: KVCacheManager, rid: str, tokens: list[int]) -> tuple[int, list[int]]:
    mgr.add_request(Request(rid, tokens))
    hit = mgr.lookup(rid)
    mgr.allocate(rid, len(tokens) - hit.hit, lookup=hit)
    step = mgr.seal_step()
    mgr.commit(step.step_id, {rid: (len(tokens), [0])})
    mgr.finish(rid)
    return hit.hit, [op.tier for op in step.tier_ops if isinstance(op, Load)]


CFG = CacheConfig(num_blocks=6, groups=[GroupSpec(kind="full", block_size=4)])


def test_a_session_moved_to_another_replica_reuses_its_history_from_the_store() -> None:
    store = SharedTier(TierSpec("store", 16), CFG)
    a, b = (KVCacheManager(CFG, tiers=[store]) for _ in range(2))
    history = list(range(17))
    assert run_one(a, "t1", history) == (0, [])
    run_one(a, "other", list(range(100, 118)))  # a's pages go down to the store
    hit, loads = run_one(b, "t2", [*history, 50, 51, 52])  # the next turn, on b
    assert hit == 16 and loads == [0] * 4  # its whole history, from the shared store
    for mgr in (a, b):
        mgr.check_invariants()


def test_a_reset_leaves_the_shared_tier() -> None:
    store = SharedTier(TierSpec("store", 16), CFG)
    a, b = (KVCacheManager(CFG, tiers=[store]) for _ in range(2))
    run_one(a, "t1", list(range(17)))
    run_one(a, "other", list(range(100, 118)))
    held = len(store)
    assert held and a.reset()
    assert len(store) == held
    assert run_one(b, "t2", list(range(17)))[0] == 16


def test_another_cache_layout_cannot_share_the_tier() -> None:
    store = SharedTier(TierSpec("store", 16), CFG)
    KVCacheManager(CacheConfig(num_blocks=64, groups=CFG.groups), tiers=[store])  # pool size: ok
    other = CacheConfig(num_blocks=6, groups=[GroupSpec(kind="full", block_size=8)])
    with pytest.raises(ConfigError, match="another cache layout"):
        KVCacheManager(other, tiers=[store])


def test_a_manager_waits_for_the_others_ops_on_the_shared_tier() -> None:
    """A demote decided but not yet taken names a slot whose bytes are not written: another
    manager may neither read the tier nor reuse that slot until the step is sealed."""
    store = SharedTier(TierSpec("store", 1), CFG)
    a, b = (KVCacheManager(CFG, tiers=[store]) for _ in range(2))
    run_one(a, "t1", list(range(17)))
    a.add_request(Request("t2", list(range(100, 118))))
    a.allocate("t2", 18, lookup=a.lookup("t2"))  # evicts t1's pages: demotes, not yet sealed
    b.add_request(Request("t3", list(range(17))))
    with pytest.raises(SharedTierBusyError, match="one at a time"):
        b.lookup("t3")
    assert any(isinstance(op, Demote) for op in a.seal_step().tier_ops)
    assert b.lookup("t3").hit == 4  # the one slot holds t1's first page


def test_a_lookup_made_before_another_managers_step_is_stale() -> None:
    store = SharedTier(TierSpec("store", 16), CFG)
    a, b = (KVCacheManager(CFG, tiers=[store]) for _ in range(2))
    run_one(a, "t1", list(range(17)))
    run_one(a, "t2", list(range(100, 118)))
    b.add_request(Request("t3", list(range(17))))
    res = b.lookup("t3")
    assert res.loads
    run_one(a, "t4", list(range(200, 220)))  # a's turn: the store's slots change
    with pytest.raises(StaleLookupError):
        b.allocate("t3", 1, lookup=res)
    assert b.allocate("t3", 1, lookup=b.lookup("t3")) is not None


def test_a_copy_between_its_turns_refuses_any_change() -> None:
    """A copy of the store in another process may change only in its turn: outside it, a
    demote that would change its slots is one loud error, and the copy is as it was."""
    store = SharedTier(TierSpec("store", 16), CFG)
    a = KVCacheManager(CFG, tiers=[store])
    run_one(a, "doc", list(range(17)))
    store.close_turn()
    before = dict(store.slots)
    with pytest.raises(SharedTierBusyError, match="outside this replica's turn"):
        run_one(a, "flood", list(range(100, 118)))  # evicts doc's pages into the store
    assert store.slots == before
    store.open_turn()


def test_a_replay_that_does_not_fit_its_copy_is_refused() -> None:
    store = SharedTier(TierSpec("store", 16), CFG)
    store.record()
    a = KVCacheManager(CFG, tiers=[store])
    run_one(a, "doc", list(range(17)))
    run_one(a, "flood", list(range(100, 118)))
    changes = store.take_journal()
    assert any(c[0] == "place" for c in changes)
    drifted = SharedTier(TierSpec("store", 16), CFG)
    drifted.replay([c for c in changes if c[0] == "place"][:1])  # one placement ahead
    with pytest.raises(InvariantError, match="replay drifted"):
        drifted.replay(changes)
