"""Block pool and LRU free queue (spec §11.1–11.4), tested below the manager."""

from __future__ import annotations

import pytest

from kvreuse import CacheConfig, GroupSpec, KVCacheManager, LRUPolicy, Request
from kvreuse.core.events import EventLog
from kvreuse.core.pool import BlockPool


def make_pool(num_blocks: int = 8, ghost: int | None = None, dcp: int = 4) -> BlockPool:
    cfg = CacheConfig(
        num_blocks=num_blocks,
        dcp_size=dcp,
        ghost_capacity=ghost,
        groups=[GroupSpec(kind="full", block_size=16), GroupSpec(kind="recurrent", block_size=16)],
    )
    return BlockPool(cfg, EventLog(True, None))


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
    pool.publish(0, 16, b"k16", a)
    pool.publish(0, 32, b"k32", a)  # a's highest boundary is 32
    pool.publish(0, 80, b"k80", b)
    pool.publish(0, 48, b"k48", c)
    pool.release([a, b, c, d])  # d is unkeyed
    assert order(pool) == [d, 5, 6, 7, b, c, a]


def test_ties_break_by_group_then_block_id() -> None:
    pool = make_pool()
    x, y = pool.pop(1), pool.pop(0)  # 1 in recurrent group, 2 in full group
    pool.publish(1, 64, b"s64", x)
    pool.publish(0, 64, b"f64", y)
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
        assert pool.publish(0, b, f"k{b}".encode(), blk)
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
        pool.publish(0, b, f"k{b}".encode(), blk)
    pool.release([blk])
    pool.evict(blk)
    assert list(pool.ghost) == [(0, b"k32"), (0, b"k48")]
    other = pool.pop(0)
    pool.publish(0, 48, b"k48", other)
    assert list(pool.ghost) == [(0, b"k32")]


def test_publish_keeps_the_first_publisher() -> None:
    pool = make_pool()
    a, b = pool.pop(0), pool.pop(0)
    assert pool.publish(0, 16, b"k", a)
    assert not pool.publish(0, 16, b"k", b)
    assert pool.index[0][b"k"] == a and not pool.has_keys(b)
    assert pool.publish(1, 16, b"k", b)  # the same hash in another group is another key


def test_targeted_eviction_rules() -> None:
    pool = make_pool()
    blk = pool.pop(0)
    pool.publish(0, 16, b"k", blk)
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
