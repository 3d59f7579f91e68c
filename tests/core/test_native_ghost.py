"""The C ghost record (`_native.Ghost`) against `GhostRecord` (the reference) and against the
rule itself (a FIFO of the newest `capacity` keys over all groups): the same random operations,
every observable compared after each one. Skipped when the extension was not built.
"""

from __future__ import annotations

import copy
import pickle
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from depth import scaled
from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.core import native
from kvreuse.core.ghost import Ghost, GhostRecord, new_ghost
from test_native import _ext

KEYS = [bytes([i]) * 32 for i in range(10)]


class Model:
    """The rule: (gid, key, boundary) oldest first; a key added again becomes the newest."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.rows: list[tuple[int, bytes, int]] = []

    def add_many(self, rows: list[tuple[int, bytes, int]]) -> None:
        if not self.capacity:
            return
        for gid, key, bd in rows:
            self.discard_many(gid, [key])
            self.rows.append((gid, key, bd))
        del self.rows[: max(0, len(self.rows) - self.capacity)]

    def discard_many(self, gid: int, keys: list[bytes]) -> None:
        self.rows = [r for r in self.rows if not (r[0] == gid and r[1] in keys)]


def _observe(ghost: Ghost, num_groups: int) -> tuple[Any, ...]:
    pairs = [(g, k) for g in range(num_groups) for k in KEYS]
    return (
        len(ghost),
        bool(ghost),
        ghost.capacity,
        ghost.entries(),
        list(ghost),
        [ghost.contains(g, k) for g, k in pairs],
        [(g, k) in ghost for g, k in pairs],
        [item in ghost for item in ((0,), (0, KEYS[0], 1), [0, KEYS[0]], "ab", None)],
    )


def _expect(model: Model, num_groups: int) -> tuple[Any, ...]:
    rows = model.rows
    live = {(g, k) for g, k, _ in rows}
    pairs = [(g, k) for g in range(num_groups) for k in KEYS]
    flags = [p in live for p in pairs]
    return (
        len(rows),
        bool(rows),
        model.capacity,
        [(g, b, k) for g, k, b in rows],
        [(g, k) for g, k, _ in rows],
        flags,
        flags,
        [False] * 5,
    )


def _ops(num_groups: int) -> st.SearchStrategy[list[tuple[Any, ...]]]:
    gid = st.integers(0, num_groups - 1)
    key = st.sampled_from(KEYS)
    row = st.tuples(gid, key, st.integers(0, 2**31 - 1))
    op = st.one_of(
        st.tuples(st.just("add_many"), st.lists(row, max_size=12)),
        st.tuples(st.just("add"), row),
        st.tuples(st.just("discard_many"), gid, st.lists(key, max_size=12)),
        st.tuples(st.just("discard"), gid, key),
        st.tuples(st.just("clear")),
    )
    return st.lists(op, max_size=40)


def _apply(ghost: Ghost, op: tuple[Any, ...]) -> None:
    name = op[0]
    if name == "add_many":
        ghost.add_many(list(op[1]))
    elif name == "add":
        ghost.add(*op[1])
    elif name == "discard_many":
        ghost.discard_many(op[1], list(op[2]))
    elif name == "discard":
        ghost.discard(op[1], op[2])
    else:
        ghost.clear()


def _model_apply(model: Model, op: tuple[Any, ...]) -> None:
    name = op[0]
    if name in ("add_many", "add"):
        model.add_many(list(op[1]) if name == "add_many" else [op[1]])
    elif name in ("discard_many", "discard"):
        model.discard_many(op[1], list(op[2]) if name == "discard_many" else [op[2]])
    else:
        model.rows.clear()


@st.composite
def _histories(draw: st.DrawFn) -> tuple[int, int, list[tuple[Any, ...]]]:
    num_groups = draw(st.integers(1, 3))
    capacity = draw(st.sampled_from([0, 1, 2, 3, 5, 8, 40]))
    return num_groups, capacity, draw(_ops(num_groups))


@given(history=_histories())
@settings(max_examples=scaled(300), deadline=2000)
def test_both_records_follow_the_rule_after_every_operation(
    history: tuple[int, int, list[tuple[Any, ...]]],
) -> None:
    """Several groups, capacities 0 and 1 among them, keys discarded and added again (also
    while still present), batches larger than the capacity."""
    num_groups, capacity, ops = history
    ext = _ext()
    ghosts: list[Ghost] = [ext.Ghost(num_groups, capacity), GhostRecord(num_groups, capacity)]
    model = Model(capacity)
    for op in ops:
        _model_apply(model, op)
        want = _expect(model, num_groups)
        for ghost in ghosts:
            _apply(ghost, op)
            assert _observe(ghost, num_groups) == want, (type(ghost).__name__, op)


def test_a_long_history_grows_and_compacts_the_ring_alike() -> None:
    """Thousands of keys, most discarded before they age out: the C ring grows, fills with
    dead slots and is compacted many times; both records stay equal throughout."""
    ext = _ext()
    rng = random.Random(7)
    native_ghost, pure = ext.Ghost(3, 500), GhostRecord(3, 500)
    keys = [rng.randbytes(32) for _ in range(3000)]
    for step in range(4000):
        gid = rng.randrange(3)
        batch = [(gid, rng.choice(keys), rng.randrange(1 << 20)) for _ in range(rng.randrange(20))]
        gone = [rng.choice(keys) for _ in range(rng.randrange(30))]
        target = rng.randrange(3) if step % 5 else gid
        for ghost in (native_ghost, pure):
            ghost.add_many(batch)
            ghost.discard_many(target, gone)
        if step % 97 == 0:
            assert native_ghost.entries() == pure.entries()
    assert native_ghost.entries() == pure.entries() and len(native_ghost) == len(pure)


def test_the_c_record_survives_deepcopy_and_pickle() -> None:
    ghost = _ext().Ghost(2, 4)
    ghost.add_many([(0, KEYS[0], 16), (1, KEYS[1], 32), (0, KEYS[2], 48)])
    ghost.discard(0, KEYS[0])
    for twin in (copy.deepcopy(ghost), pickle.loads(pickle.dumps(ghost))):
        assert twin.entries() == ghost.entries() and twin.capacity == 4
        twin.add_many([(1, KEYS[3], 1), (1, KEYS[4], 2), (1, KEYS[5], 3)])
        assert twin.entries()[0] == (0, 48, KEYS[2]) and len(ghost) == 2


def test_bad_arguments_are_one_clear_error_on_the_c_record() -> None:
    ghost = _ext().Ghost(2, 4)
    with pytest.raises(TypeError, match="bytes"):
        ghost.add(0, "not bytes", 1)  # type: ignore[arg-type]
    with pytest.raises(IndexError, match="group id"):
        ghost.add(2, KEYS[0], 1)
    with pytest.raises(TypeError, match="group_id, key, boundary"):
        ghost.add_many([(0, KEYS[0])])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        ghost.contains(0, [1])  # type: ignore[arg-type]  # unhashable, as in a dict
    with pytest.raises(ValueError, match="num_groups"):
        _ext().Ghost(0, 4)
    assert len(ghost) == 0


def _manager(ext: Any) -> KVCacheManager:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "ext", ext)
        return KVCacheManager(
            CacheConfig(
                num_blocks=12,
                groups=[GroupSpec(kind="full", block_size=4)],
                hash_unit=4,
                ghost_capacity=5,
            )
        )


def test_the_pool_holds_the_c_record_on_the_native_path_only() -> None:
    """Evictions fill it and trim it to the capacity, publication takes keys back out, a deep
    copy of the manager keeps it, and `reset` empties it: alike on both paths."""
    ext = _ext()
    mgrs = [_manager(ext), _manager(None)]
    assert isinstance(mgrs[0].pool.ghost, ext.Ghost)
    assert isinstance(mgrs[1].pool.ghost, GhostRecord)
    assert type(new_ghost(1, 1)) is (GhostRecord if native.ext is None else ext.Ghost)
    rng = random.Random(5)
    for i in range(60):
        toks = [rng.randrange(3) for _ in range(rng.randrange(4, 30))]
        for mgr in mgrs:
            mgr.add_request(Request(f"r{i}", prompt_token_ids=toks))
            res = mgr.lookup(f"r{i}")
            if mgr.allocate(f"r{i}", len(toks) - res.hit, lookup=res) is not None:
                step = mgr.seal_step()
                mgr.commit(step.step_id, {f"r{i}": (len(toks), [1])})
            mgr.finish(f"r{i}")
        assert mgrs[0].export_ghost() == mgrs[1].export_ghost()
        assert len(mgrs[0].pool.ghost) <= 5
    assert mgrs[0].export_ghost(), "the history evicts"
    template = mgrs[0].hasher.template  # immutable, holds a Struct (as the harness copies it)
    twin = copy.deepcopy(mgrs[0], memo={id(template): template})
    assert twin.export_ghost() == mgrs[0].export_ghost()
    for mgr in mgrs:
        mgr.reset()
        assert mgr.export_ghost() == [] and len(mgr.pool.ghost) == 0
