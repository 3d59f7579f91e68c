"""Block pool and LRU free queue (spec §11.1–11.4), tested below the manager."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvreuse import CacheConfig, EvictionPolicy, GroupSpec, KVCacheManager, LRUPolicy, Request
from kvreuse.core.events import EventLog, stored_runs
from kvreuse.core.ghost import GhostRecord
from kvreuse.core.policy import pop_many_of
from kvreuse.core.pool import BlockPool


def make_pool(num_blocks: int = 8, ghost: int | None = None, dcp: int = 4) -> BlockPool:
    cfg = CacheConfig(
        num_blocks=num_blocks,
        dcp_size=dcp,
        ghost_capacity=ghost,
        groups=[GroupSpec(kind="full", block_size=16), GroupSpec(kind="recurrent", block_size=16)],
    )
    return BlockPool(cfg, EventLog(True, None))


def publish(pool: BlockPool, gid: int, boundary: int, key: bytes, block_id: int) -> bool:
    """One entry through the pool's publication path (no request: these tests take no event)."""
    return pool.publish(gid, [boundary], [key], [block_id], None) == [boundary]


def order(pool: BlockPool) -> list[int]:
    assert isinstance(pool.policy, LRUPolicy)
    return pool.policy.order()


def test_initial_queue_is_ascending_and_pop_takes_the_head() -> None:
    pool = make_pool()
    assert order(pool) == [1, 2, 3, 4, 5, 6, 7]
    assert [pool.pop(0) for _ in range(3)] == [1, 2, 3]
    assert order(pool) == [4, 5, 6, 7]
    assert pool.num_free == 4


@pytest.mark.parametrize(
    ("release", "expected"),
    [
        # unkeyed blocks go to the head as one run, in the given order
        ([3, 2, 1], [3, 2, 1, 4, 5, 6, 7]),
        ([1, 3], [1, 3, 4, 5, 6, 7]),
    ],
)
def test_unkeyed_run_goes_to_the_head(release: list[int], expected: list[int]) -> None:
    pool = make_pool()
    for _ in range(3):
        pool.pop(0)
    pool.release(release)
    assert order(pool)[: len(expected)] == expected[: len(order(pool))]


def test_keyed_blocks_go_to_the_tail_by_decreasing_highest_boundary() -> None:
    pool = make_pool()
    a, b, c, d = (pool.pop(0) for _ in range(4))  # 1, 2, 3, 4
    publish(pool, 0, 16, b"k16", a)
    publish(pool, 0, 32, b"k32", a)  # a's highest boundary is 32
    publish(pool, 0, 80, b"k80", b)
    publish(pool, 0, 48, b"k48", c)
    pool.release([a, b, c, d])  # d is unkeyed
    assert order(pool) == [d, 5, 6, 7, b, c, a]


def test_ties_break_by_group_then_block_id() -> None:
    pool = make_pool()
    x, y = pool.pop(1), pool.pop(0)  # 1 in recurrent group, 2 in full group
    publish(pool, 1, 64, b"s64", x)
    publish(pool, 0, 64, b"f64", y)
    pool.release([x, y])
    assert order(pool)[-2:] == [y, x]


def test_adopt_removes_from_the_middle_and_counts_references() -> None:
    pool = make_pool()
    pool.adopt(4)
    assert order(pool) == [1, 2, 3, 5, 6, 7]
    pool.adopt(4)
    assert pool.ref[4] == 2
    pool.release([4])
    assert 4 not in pool.policy
    pool.release([4])
    assert order(pool)[0] == 4


def test_popping_a_keyed_block_evicts_every_key_into_the_ghost_record() -> None:
    pool = make_pool(num_blocks=3)
    blk = pool.pop(0)
    for b in (16, 32, 48, 64):
        assert publish(pool, 0, b, f"k{b}".encode(), blk)
    pool.release([blk])
    pool.pop(0)  # block 2, unkeyed
    again = pool.pop(0)
    assert again == blk and pool.ref[blk] == 1
    assert pool.index[0] == {}
    assert list(pool.ghost) == [(0, b"k16"), (0, b"k32"), (0, b"k48"), (0, b"k64")]
    removed = [r for r in pool.events.pending if r[0] == "R"]
    assert [r[4] for r in removed] == [16, 32, 48, 64]
    assert [r[5] for r in removed] == ["partial", "partial", "partial", "full"]
    assert pool.num_evicted_blocks == 1 and pool.num_removed_keys == 4


def test_ghost_record_is_a_bounded_fifo_and_republishing_leaves_it() -> None:
    pool = make_pool(num_blocks=3, ghost=2)
    blk = pool.pop(0)
    for b in (16, 32, 48):
        publish(pool, 0, b, f"k{b}".encode(), blk)
    pool.release([blk])
    pool.evict(blk)
    assert list(pool.ghost) == [(0, b"k32"), (0, b"k48")]
    other = pool.pop(0)
    publish(pool, 0, 48, b"k48", other)
    assert list(pool.ghost) == [(0, b"k32")]


def test_publish_keeps_the_first_publisher() -> None:
    pool = make_pool()
    a, b = pool.pop(0), pool.pop(0)
    assert publish(pool, 0, 16, b"k", a)
    assert not publish(pool, 0, 16, b"k", b)
    assert pool.index[0][b"k"] == a and not pool.has_keys(b)
    assert publish(pool, 1, 16, b"k", b)  # the same hash in another group is another key


def test_targeted_eviction_rules() -> None:
    pool = make_pool()
    blk = pool.pop(0)
    publish(pool, 0, 16, b"k", blk)
    with pytest.raises(ValueError, match="in use"):
        pool.evict(blk)
    pool.release([blk])
    position = order(pool).index(blk)
    pool.evict(blk)
    assert order(pool).index(blk) == position  # keeps its queue place
    with pytest.raises(ValueError, match="no key"):
        pool.evict(blk)
    with pytest.raises(ValueError, match="null block"):
        pool.evict(0)


class FifoPolicy:
    """A custom policy: hand out blocks in the order they were released (ignores keys)."""

    def __init__(self, view) -> None:
        self.view = view
        self.queue: dict[int, None] = {}

    def release(self, unkeyed, keyed) -> None:
        for b in (*unkeyed, *keyed):
            self.queue[b] = None

    def remove(self, block_id: int) -> None:
        del self.queue[block_id]

    def pop(self) -> int:
        b = next(iter(self.queue))
        del self.queue[b]
        assert self.view.ref_count(b) == 0
        return b

    def __len__(self) -> int:
        return len(self.queue)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.queue


def test_custom_eviction_policy_is_filled_and_used() -> None:
    cfg = CacheConfig(
        num_blocks=6, groups=[GroupSpec(kind="full", block_size=4)], eviction_policy=FifoPolicy
    )
    mgr = KVCacheManager(cfg)
    assert list(mgr.pool.policy.queue) == [1, 2, 3, 4, 5]
    mgr.add_request(Request("a", prompt_token_ids=list(range(9))))
    res = mgr.lookup("a")
    plan = mgr.allocate("a", 9, lookup=res)
    assert plan is not None and plan.tables[0] == [1, 2, 3]
    step = mgr.seal_step()
    mgr.commit(step.step_id, {"a": (9, [1])})
    mgr.finish("a")
    mgr.check_invariants()
    assert mgr.pool.release_seq(3) >= 1
    assert mgr.pool.keys(1) == [(4, "full")]
    assert mgr.pool.group_id(1) == 0


# ---------------------------------------------------------------------- one publication path
def test_publish_skips_null_blocks_and_present_keys_and_returns_what_it_published() -> None:
    pool = make_pool(num_blocks=12, dcp=1)  # page = unit = 16
    a, b, c, d = pool.pop_many(0, 4)
    assert publish(pool, 0, 32, b"k32", b)  # already present: skipped below
    done = pool.publish(0, [16, 32, 48, 64], [b"k16", b"k32", b"k48", b"k64"], [a, b, 0, d], None)
    assert done == [16, 64]
    assert pool.index[0] == {b"k16": a, b"k32": b, b"k64": d}
    assert not pool.has_keys(c)
    assert pool.num_published == {"full": 3, "partial": 0, "state": 0}


def test_publish_fast_and_general_paths_leave_the_same_pool() -> None:
    """page = unit: fresh pages take the one-update path; a present key forces the general
    loop for the whole run. Both key every fresh page alike."""
    keys = [f"k{i}".encode() for i in range(1, 6)]
    fast, slow = make_pool(num_blocks=12, dcp=1), make_pool(num_blocks=12, dcp=1)
    for pool in (fast, slow):
        pool.pop_many(0, 5)
    assert fast.publish(0, range(16, 81, 16), keys, [1, 2, 3, 4, 5], None) == [16, 32, 48, 64, 80]
    assert publish(slow, 0, 16, keys[0], 1)  # present: this one run takes the general loop
    assert slow.publish(0, range(16, 81, 16), keys, [1, 2, 3, 4, 5], None) == [32, 48, 64, 80]
    for b in range(1, 6):
        assert fast.key_list(b) == slow.key_list(b)
    assert fast.num_published == slow.num_published == {"full": 5, "partial": 0, "state": 0}


def test_publish_counts_kinds_and_attaches_sub_page_keys() -> None:
    pool = make_pool()  # full attention sharded over 4 ranks: page 64, unit 16
    blk, state = pool.pop(0), pool.pop(1)
    keys = [b"k16", b"k32", b"k48", b"k64"]
    assert pool.publish(0, [16, 32, 48, 64], keys, [blk] * 4, None) == [16, 32, 48, 64]
    assert pool.keys(blk) == [(16, "partial"), (32, "partial"), (48, "partial"), (64, "full")]
    assert pool.publish(1, [64], [b"s64"], [state], None) == [64]
    assert pool.num_published == {"full": 1, "partial": 3, "state": 1}


def test_publish_records_one_block_stored_per_run() -> None:
    pool = make_pool(num_blocks=12, dcp=1)
    blocks = pool.pop_many(0, 5)
    assert publish(pool, 0, 48, b"k48", blocks[2])
    pool.events.pending.clear()
    req = object()  # the source: events are built from it only when taken
    keys = [b"k16", b"k32", b"k48", b"k64", b"k80"]
    pool.publish(0, range(16, 81, 16), keys, blocks, req)  # type: ignore[arg-type]
    stored = [r for r in pool.events.pending if r[0] == "S"]
    assert [(r[2], r[3], r[4]) for r in stored] == [(req, 0, [16, 32]), (req, 0, [64, 80])]
    states = pool.pop_many(1, 3)
    pool.publish(1, [16, 32, 64], [b"s16", b"s32", b"s64"], states, req)  # type: ignore[arg-type]
    stored = [r for r in pool.events.pending if r[0] == "S"][2:]
    # M = 16: each state's page starts at the previous state, except 64 (its page starts at 48)
    assert [r[4] for r in stored] == [[16, 32], [64]]


@pytest.mark.parametrize(
    ("boundaries", "unit", "state_page", "runs"),
    [
        ([16], 16, 0, [[16]]),
        ([16, 32, 64, 80, 96], 16, 0, [[16, 32], [64, 80, 96]]),  # a skipped 48 ends a run
        ([144, 160, 176, 192, 208], 16, 0, [[144, 160, 176, 192, 208]]),
        ([64, 128, 256], 16, 64, [[64, 128], [256]]),  # 256's page starts at 192
        ([48, 64], 16, 64, [[48], [64]]),  # 64's page starts at 0, not at 48
        ([64, 80], 16, 16, [[64, 80]]),
    ],
)
def test_stored_runs_rules(
    boundaries: list[int], unit: int, state_page: int, runs: list[list[int]]
) -> None:
    got = stored_runs(boundaries, unit, state_page)
    assert got == runs
    assert all(run is not boundaries for run in got)  # the log never aliases the caller's list


# ---------------------------------------------------------------------- one eviction path
def test_pop_is_pop_many_of_one_and_pop_many_evicts_in_order() -> None:
    one, many = make_pool(num_blocks=6), make_pool(num_blocks=6)
    for pool in (one, many):
        blocks = pool.pop_many(0, 5)
        for i, blk in enumerate(blocks):
            publish(pool, 0, 16 * (i + 1), f"k{i}".encode(), blk)
        pool.release(blocks)
    popped = [one.pop(1) for _ in range(3)]
    assert popped == many.pop_many(1, 3)
    assert list(one.ghost) == list(many.ghost)
    assert list(one.events.pending) == list(many.events.pending)
    assert [one.group_id(b) for b in popped] == [1, 1, 1] == [many.group_id(b) for b in popped]
    assert one.num_evicted_blocks == many.num_evicted_blocks == 3
    assert many.pop_many(0, 0) == []


def test_targeted_eviction_records_what_pop_would() -> None:
    pool = make_pool(num_blocks=4)
    blk = pool.pop(0)
    for b in (16, 32):
        publish(pool, 0, b, f"k{b}".encode(), blk)
    pool.release([blk])
    pool.events.pending.clear()
    pool.evict(blk)
    assert [r[4] for r in pool.events.pending] == [16, 32]
    assert pool.ref_count(blk) == 0 and pool.group_id(blk) is None
    assert list(pool.ghost) == [(0, b"k16"), (0, b"k32")]
    assert pool.num_removed_keys == 2 and pool.num_evicted_blocks == 1


def test_clear_keys_records_all_blocks_cleared() -> None:
    pool = make_pool()
    publish(pool, 0, 16, b"k", pool.pop(0))
    pool.events.pending.clear()
    pool.clear_keys()
    assert [r[0] for r in pool.events.pending] == ["C"]
    quiet = BlockPool(
        CacheConfig(num_blocks=4, groups=[GroupSpec(kind="full", block_size=16)]),
        EventLog(False, None),
    )
    quiet.clear_keys()
    assert not quiet.events.pending


class PopOnlyLRU:
    """A custom policy written before pop_many: LRU order through `pop` alone."""

    def __init__(self, num_blocks: int) -> None:
        self.lru = LRUPolicy(num_blocks)

    def release(self, unkeyed, keyed) -> None:
        self.lru.release(unkeyed, keyed)

    def remove(self, block_id: int) -> None:
        self.lru.remove(block_id)

    def pop(self) -> int:
        return self.lru.pop()

    def __len__(self) -> int:
        return len(self.lru)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.lru


def test_a_policy_without_pop_many_gives_the_blocks_lru_gives() -> None:
    assert not hasattr(PopOnlyLRU, "pop_many")
    cfg = CacheConfig(
        num_blocks=14,
        dcp_size=4,
        groups=[GroupSpec(kind="full", block_size=16), GroupSpec(kind="recurrent", block_size=16)],
    )
    runs = []
    for policy in ("lru", lambda view: PopOnlyLRU(14)):
        mgr = KVCacheManager(replace(cfg, eviction_policy=policy))
        plans = []
        for i in range(8):  # pressure: later admissions evict the earlier ones' keys
            rid = f"r{i}"
            mgr.add_request(Request(rid, prompt_token_ids=[i % 3] * 40 + list(range(i, i + 60))))
            res = mgr.lookup(rid)
            plan = mgr.allocate(rid, 100 - res.hit, lookup=res)
            assert plan is not None
            plans.append(plan.tables)
            mgr.commit(mgr.seal_step().step_id, {rid: (100, [1])})
            mgr.finish(rid)
            mgr.check_invariants()
        assert mgr.pool.num_evicted_blocks > 0
        runs.append((plans, mgr.take_events(), mgr.export_entries(), mgr.export_ghost()))
    assert runs[0] == runs[1]


def test_pop_many_of_prefers_the_policy_s_own() -> None:
    lru = LRUPolicy(6)
    lru.release([1, 2, 3, 4, 5], [])
    assert pop_many_of(lru) == lru.pop_many
    assert pop_many_of(lru)(2) == [1, 2]
    fallback = PopOnlyLRU(6)
    fallback.release([1, 2, 3, 4, 5], [])
    assert pop_many_of(fallback)(3) == [1, 2, 3] and len(fallback) == 2


def test_protocol_subclasses_inherit_pop_many() -> None:
    class Stack(EvictionPolicy):
        def __init__(self) -> None:
            self.items: list[int] = []

        def release(self, unkeyed, keyed) -> None:
            self.items.extend((*unkeyed, *keyed))

        def remove(self, block_id: int) -> None:
            self.items.remove(block_id)

        def pop(self) -> int:
            return self.items.pop()

        def __len__(self) -> int:
            return len(self.items)

        def __contains__(self, block_id: object) -> bool:
            return block_id in self.items

    s = Stack()
    s.release([1, 2], [3])
    assert s.pop_many(2) == [3, 2]


# ---------------------------------------------------------------------- the ghost record
def test_ghost_record_changes_only_through_its_methods() -> None:
    ghost = GhostRecord(2, 3)
    assert not hasattr(ghost, "by_group") and not hasattr(ghost, "size")
    ghost.add(0, b"a", 16)
    ghost.add_many([(1, b"b", 32), (0, b"c", 48)])
    assert len(ghost) == 3 and ghost and ghost.capacity == 3
    assert (1, b"b") in ghost and ghost.contains(1, b"b") and not ghost.contains(0, b"b")
    assert (0, b"b") not in ghost and "junk" not in ghost
    ghost.add_many([(1, b"d", 64), (1, b"e", 80)])  # trims the two oldest, across groups
    assert ghost.entries() == [(0, 48, b"c"), (1, 64, b"d"), (1, 80, b"e")]
    assert list(ghost) == [(0, b"c"), (1, b"d"), (1, b"e")]
    ghost.discard_many(1, [b"d", b"zz"])
    ghost.discard(0, b"c")
    ghost.discard(0, b"c")  # absent: nothing changes
    assert list(ghost) == [(1, b"e")] and len(ghost) == 1
    ghost.clear()
    assert len(ghost) == 0 and not ghost and list(ghost) == []


def test_ghost_batch_add_keeps_what_single_adds_keep() -> None:
    one, batch = GhostRecord(2, 4), GhostRecord(2, 4)
    items = [(i % 2, f"k{i}".encode(), 16 * i) for i in range(1, 10)]
    for item in items:
        one.add(*item)
    batch.add_many(items)
    assert one.entries() == batch.entries() and len(one) == len(batch) == 4


def test_a_ghost_of_capacity_zero_keeps_nothing() -> None:
    ghost = GhostRecord(1, 0)
    ghost.add_many([(0, b"a", 16)])
    assert len(ghost) == 0 and not ghost.contains(0, b"a")


@pytest.mark.parametrize("num_keys", [1, 3, 8, 20])
def test_ghost_discard_many_removes_exactly_the_remembered_keys(num_keys: int) -> None:
    ghost = GhostRecord(2, 100)
    ghost.add_many([(0, f"k{i}".encode(), 16 * i) for i in range(10)])
    ghost.add(1, b"k1", 16)  # the same hash in another group is another key
    ghost.discard_many(0, [f"k{i}".encode() for i in range(0, 2 * num_keys, 2)])
    kept = [(0, f"k{i}".encode()) for i in range(10) if not (i % 2 == 0 and i < 2 * num_keys)]
    assert list(ghost) == [*kept, (1, b"k1")] and len(ghost) == len(kept) + 1
