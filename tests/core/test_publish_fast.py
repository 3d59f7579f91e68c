"""Publication and release shortcuts against their reference loops.

* The native publication kernel (`publish_keys`) against `BlockPool._publish_each` on random
  publications that reach every case: NULL pages, keys already present, sub-page keys added in
  ascending order and below a block's highest key (the kernel stops there and the Python loop
  goes on), blocks given twice.
* The native release kernel (`release_refs`) against `release`'s Python loop and `_queue` on
  random batches: repeated references, keyed and unkeyed blocks, several groups, equal
  boundaries, tail orders given already sorted or not.
* A finish releases a table with NULL slots (pages that left a sliding window) and returns the
  statistics it keeps, whatever finished_stats_capacity keeps.

The kernel tests are skipped when the extension was not built.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.core import native
from kvreuse.core.pool import BlockPool
from test_native import _ext
from test_native_pool import _pool_state

NUM_BLOCKS = 24


def _manager(ext: Any, groups: list[GroupSpec], hash_unit: int, **kw: Any) -> KVCacheManager:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "ext", ext)
        return KVCacheManager(
            CacheConfig(num_blocks=NUM_BLOCKS, groups=groups, hash_unit=hash_unit, **kw)
        )


def _random_publication(
    rng: random.Random, pool: BlockPool, group_id: int, keys: list[bytes]
) -> tuple[list[int], list[bytes], list[int]]:
    """Ascending boundaries on random blocks (NULL among them), fresh or already used keys."""
    n = rng.randrange(1, 9)
    start = rng.randrange(0, 40)
    boundaries = [2 * x for x in sorted(rng.sample(range(start, start + 60), n))]  # unit 2
    blocks = [rng.choice([0, *range(1, NUM_BLOCKS)]) for _ in range(n)]
    chosen = [
        rng.choice(keys) if keys and rng.random() < 0.3 else rng.randbytes(8) for _ in range(n)
    ]
    keys.extend(chosen)
    return boundaries, chosen, blocks


@pytest.mark.parametrize("seed", range(40))
def test_the_publication_kernel_matches_the_python_loop(seed: int) -> None:
    ext = _ext()
    groups = [GroupSpec(kind="full", block_size=8), GroupSpec(kind="full", block_size=2)]
    mgrs = [_manager(ext, groups, 2), _manager(None, groups, 2)]
    assert mgrs[0].pool._k_publish is not None and mgrs[1].pool._k_publish is None
    rng = random.Random(seed)
    keys: list[bytes] = []
    for _ in range(30):
        gid = rng.randrange(2)
        call = _random_publication(rng, mgrs[0].pool, gid, keys)
        done = [m.pool._publish_each(gid, *call) for m in mgrs[1:]]  # the reference loop
        got = mgrs[0].pool.publish(gid, *call, None)  # type: ignore[arg-type]
        assert got == done[0]
        assert _pool_state(mgrs[0]) == _pool_state(mgrs[1])


def test_a_key_below_the_blocks_highest_is_sorted_in_on_the_native_path() -> None:
    """The kernel's stop: block 5 keyed at 8, then at 4 and 6 in one call (below its highest),
    then at 12 (ascending again); the lower keys stay sorted and every key is found."""
    ext = _ext()
    groups = [GroupSpec(kind="full", block_size=8)]
    mgrs = [_manager(ext, groups, 2), _manager(None, groups, 2)]
    for mgr in mgrs:
        pool = mgr.pool
        assert pool.publish(0, [8], [b"k8"], [5], None) == [8]  # type: ignore[arg-type]
        got = pool.publish(0, [2, 4, 6], [b"k2", b"k4", b"k6"], [3, 5, 5], None)  # type: ignore[arg-type]
        assert got == [2, 4, 6]
        assert pool.publish(0, [12], [b"k12"], [5], None) == [12]  # type: ignore[arg-type]
        assert pool.key_list(5) == [(4, b"k4"), (6, b"k6"), (8, b"k8"), (12, b"k12")]
        assert pool.index[0] == {b"k8": 5, b"k2": 3, b"k4": 5, b"k6": 5, b"k12": 5}
    assert _pool_state(mgrs[0]) == _pool_state(mgrs[1])


def _random_batch(rng: random.Random, pool: BlockPool, multi: bool) -> list[int]:
    """References to drop: some blocks once, some twice; counts set so that some reach 0."""
    blocks = rng.sample(range(1, NUM_BLOCKS), rng.randrange(1, 16))
    ordered: list[int] = []
    for b in blocks:
        if b in pool.policy:  # a queued block: taken out as an adoption would
            pool.policy.remove(b)
        drops = rng.choice([1, 1, 2])
        pool.ref[b] = drops + rng.choice([0, 0, 1])
        ordered += [b] * drops
        if rng.random() < 0.7:  # keyed, with boundaries that often tie
            pool._key1[b] = rng.randbytes(4)
            pool._b1[b] = rng.choice([4, 8, 12, 16, 20])
            pool.group[b] = rng.randrange(2) if multi else 0
        else:
            pool._key1[b] = None
            pool.group[b] = rng.randrange(2)
    if rng.random() < 0.5:  # the tail order a table release usually has
        ordered.sort(key=lambda b: (-pool._b1[b], pool.group[b], b))
    else:
        rng.shuffle(ordered)
    return ordered


@pytest.mark.parametrize("seed", range(60))
def test_the_release_kernel_matches_the_python_queue(seed: int) -> None:
    ext = _ext()
    multi = seed % 2 == 0
    groups = [GroupSpec(kind="full", block_size=4)] * (2 if multi else 1)
    mgrs = [_manager(ext, groups, 4), _manager(None, groups, 4)]
    assert mgrs[0].pool._k_release is not None and mgrs[1].pool._k_release is None
    for round_ in range(6):
        batch = _random_batch(random.Random(seed * 100 + round_), mgrs[0].pool, multi)
        _random_batch(random.Random(seed * 100 + round_), mgrs[1].pool, multi)
        for mgr in mgrs:
            mgr.pool.release(batch)
        assert _pool_state(mgrs[0]) == _pool_state(mgrs[1])


@pytest.mark.parametrize("path", ["native", "pure"])
def test_a_finish_releases_a_table_with_pages_left_out_of_its_window(path: str) -> None:
    """A sliding group's table holds NULL where pages left the window: the finish releases
    every other slot once and the pool is whole again."""
    ext = _ext() if path == "native" else None
    groups = [
        GroupSpec(kind="full", block_size=4),
        GroupSpec(kind="sliding", block_size=4, window=6),
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "ext", ext)
        mgr = KVCacheManager(CacheConfig(num_blocks=64, groups=groups, hash_unit=4))
    tokens = list(range(1, 31))
    mgr.add_request(Request("a", prompt_token_ids=tokens))
    res = mgr.lookup("a")
    assert mgr.allocate("a", len(tokens), lookup=res) is not None
    step = mgr.seal_step()
    mgr.commit(step.step_id, {"a": (len(tokens), [7])})
    assert 0 in mgr.requests["a"].tables[1]  # pages below the window were freed
    mgr.check_invariants()
    mgr.finish("a")
    mgr.check_invariants()
    assert mgr.num_free_blocks == 63
    assert all(mgr.pool.ref_count(b) == 0 for b in range(64))


@pytest.mark.parametrize("capacity", [None, 0, 1])
def test_finish_returns_the_statistics_it_keeps(capacity: int | None) -> None:
    groups = [GroupSpec(kind="full", block_size=4)]
    mgr = _manager(native.ext, groups, 4, finished_stats_capacity=capacity)
    for rid in ("a", "b"):
        mgr.add_request(Request(rid, prompt_token_ids=list(range(1, 10))))
        res = mgr.lookup(rid)
        assert mgr.allocate(rid, 9 - res.hit, lookup=res) is not None
        step = mgr.seal_step()
        mgr.commit(step.step_id, {rid: (9, [3])})
        stats = mgr.finish(rid)
        hit = 0 if rid == "a" else mgr.replay_point(9)  # "b" resends "a"'s prompt
        assert (stats.request_id, stats.cached_tokens, stats.admissions) == (rid, hit, 1)
        if capacity != 0:
            assert mgr.request_stats(rid) == stats
