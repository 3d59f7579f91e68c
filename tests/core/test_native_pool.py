"""The pool's and the LRU queue's C kernels against their pure-Python methods (the reference):
the same random history, played once on each path, leaves every piece of pool state equal.

Both managers live in one process: owners read `native.ext` when they are constructed, so the
test builds one with the extension and one with `native.ext = None`. Skipped when the
extension was not built.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from depth import scaled
from harness import Driver, Engine
from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.core import native
from kvreuse.core.policy import LRUPolicy
from test_native import _ext
from test_properties import geometries


def _pool_state(mgr: KVCacheManager) -> tuple[Any, ...]:
    pool = mgr.pool
    policy = pool.policy
    assert isinstance(policy, LRUPolicy)
    return (
        list(pool.ref),
        bytes(pool.group),
        list(pool._key1),
        list(pool._b1),
        {b: list(keys) for b, keys in pool._more.items()},
        [list(idx.items()) for idx in pool.index],  # insertion order too
        pool.ghost.entries(),
        policy.order(),
        len(policy),
        bytes(policy._inq),
        pool.num_evicted_blocks,
        pool.num_removed_keys,
        dict(pool.num_published),
    )


def _play(cfg: CacheConfig, seed: int, rounds: int, ext: Any) -> tuple[Any, ...]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "ext", ext)
        drv = Driver(cfg, random.Random(seed))
    assert (drv.mgr.pool._k_release is not None) == (ext is not None)
    page = max(g.page_size for g in cfg.geometry.groups)
    Engine(drv, max_len=min(3 * page + 5, 120)).run(rounds)
    mgr = drv.mgr
    return drv.trace, mgr.metrics(), mgr.export_entries(), mgr.export_ghost(), _pool_state(mgr)


@given(cfg=geometries(), seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 20))
@settings(max_examples=scaled(150))
def test_both_paths_play_a_history_alike(cfg: CacheConfig, seed: int, rounds: int) -> None:
    """Random geometries (sub-page keys, several groups, small pools that evict, events) and
    histories (the property harness: every check of the oracle runs on both)."""
    ext = _ext()
    assert _play(cfg, seed, rounds, ext) == _play(cfg, seed, rounds, None)


def _cycle_manager(ext: Any, num_blocks: int) -> KVCacheManager:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "ext", ext)
        return KVCacheManager(
            CacheConfig(
                num_blocks=num_blocks,
                groups=[GroupSpec(kind="full", block_size=4)],
                hash_unit=4,
                enable_events=True,
            )
        )


def test_a_long_request_cycle_is_alike_on_both_paths() -> None:
    """The benchmark's shape at small scale: shared prefixes, waves, eviction under pressure."""
    ext = _ext()
    mgrs = [_cycle_manager(ext, 300), _cycle_manager(None, 300)]
    rng = random.Random(3)
    prefix = [rng.randrange(50) for _ in range(64)]
    live: list[str] = []
    for i in range(120):
        toks = prefix[: rng.randrange(65)] + [rng.randrange(50) for _ in range(rng.randrange(90))]
        rid = f"r{i}"
        results = []
        for mgr in mgrs:
            mgr.add_request(Request(rid, prompt_token_ids=toks or [1]))
            res = mgr.lookup(rid)
            plan = mgr.allocate(rid, len(toks or [1]) - res.hit, lookup=res)
            if plan is not None:
                step = mgr.seal_step()
                mgr.commit(step.step_id, {rid: (len(toks or [1]), [7])})
            results.append((res.hit, plan is None, mgr.take_events()))
        assert results[0] == results[1]
        if not results[0][1]:
            live.append(rid)
        if len(live) == 6 or results[0][1]:
            for r in live:
                for mgr in mgrs:
                    mgr.finish(r)
            live.clear()
        assert _pool_state(mgrs[0]) == _pool_state(mgrs[1])


@pytest.mark.parametrize("bad", [10_000, -10_000])
def test_a_block_id_out_of_range_is_an_index_error_on_the_native_path(bad: int) -> None:
    """The kernels check every id against the arrays they write (no memory corruption)."""
    pool = _cycle_manager(_ext(), 50).pool
    with pytest.raises(IndexError):
        pool.release([bad])
    with pytest.raises(IndexError):
        pool.adopt_many([bad])
    with pytest.raises(IndexError):
        pool.publish(0, [4], [b"k" * 32], [bad], None)  # type: ignore[arg-type]


class OldestBatchFirst:
    """A custom policy that reads the pool while it works: the oldest release batch first
    (`release_seq`), keyed blocks after unkeyed ones within a batch, and it checks every count
    it is shown (a block it holds has count 0 once an operation is over)."""

    def __init__(self, view: Any) -> None:
        self.view = view
        self.queue: dict[int, tuple[int, int, int]] = {}
        self.n = 0

    def release(self, unkeyed: Any, keyed: Any) -> None:
        for run, blocks in ((0, unkeyed), (1, keyed)):
            for b in blocks:
                assert self.view.ref_count(b) == 0
                self.n += 1
                self.queue[b] = (self.view.release_seq(b), run, self.n)

    def remove(self, block_id: int) -> None:
        assert self.view.ref_count(block_id) > 0  # adopted: its count already moved
        del self.queue[block_id]

    def pop(self) -> int:
        if not self.queue:
            raise IndexError("pop from an empty queue")
        b = min(self.queue, key=self.queue.__getitem__)
        del self.queue[b]
        return b

    def __len__(self) -> int:
        return len(self.queue)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.queue


@given(cfg=geometries(), seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 12))
@settings(max_examples=scaled(60))
def test_a_custom_policy_runs_with_the_kernels_and_sees_what_the_python_loops_show(
    cfg: CacheConfig, seed: int, rounds: int
) -> None:
    """The kernels run under every policy: a custom one is given the same batches, in the same
    order and with the same counts and batch numbers, on either path."""
    from dataclasses import replace

    cfg = replace(cfg, eviction_policy=OldestBatchFirst)
    ext = _ext()
    runs = []
    for path in (ext, None):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(native, "ext", path)
            drv = Driver(cfg, random.Random(seed))
        assert (drv.mgr.pool._k_release is not None) == (path is not None)
        page = max(g.page_size for g in cfg.geometry.groups)
        Engine(drv, max_len=min(3 * page + 5, 120)).run(rounds)
        mgr = drv.mgr
        policy = mgr.pool.policy
        assert isinstance(policy, OldestBatchFirst)
        runs.append((drv.trace, mgr.metrics(), mgr.export_entries(), dict(policy.queue)))
    assert runs[0] == runs[1]
