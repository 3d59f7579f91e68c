"""A mirror never forgets what its replica still holds, whatever its memo sizes.

Each history drives a real manager; its events go through the converter to a mirror whose
memo of removed boundaries is far smaller than the pool, over traffic that repeats and
interleaves (the same prompts again after others, several requests open at once) in pools
small enough to evict. After every operation the mirror's entries, boundaries included, are
exactly the replica's (`export_entries`), and no stored block ever lacks its parent's boundary.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from replica import GEOMETRIES

from depth import scaled
from kvreuse.core import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.events import Converter, ReplicaMirror
from kvreuse.events.wire import BlockStored

# every preset family of the events tests, in pools of a few dozen blocks
POOLS = {"attention": 24, "dcp4-hybrid": 40, "sliding-hybrid": 72, "spec-drop": 72}
POOLS["spec-lookahead"] = 72


def resident(mgr: KVCacheManager, num_groups: int) -> list[dict[int, int]]:
    out: list[dict[int, int]] = [{} for _ in range(num_groups)]
    for gid, boundary, key, _kind, _block in mgr.export_entries():
        out[gid][int.from_bytes(key[-8:], "big")] = boundary
    return out


class Followed:
    """A manager and a mirror fed its events; `step` checks the two agree."""

    def __init__(self, cfg: CacheConfig, memo: int) -> None:
        self.mgr = KVCacheManager(cfg)
        self.converter = Converter(cfg.geometry)
        self.mirror = ReplicaMirror(cfg.geometry, removed_memo=memo)
        self.num_groups = len(cfg.geometry.groups)
        self.open: dict[str, int] = {}  # running request → tokens it has

    def sync(self) -> None:
        self.mirror.apply(self.converter.convert(self.mgr.take_events()))
        self.mgr.check_invariants()
        got = [dict(self.mirror.entries(g)) for g in range(self.num_groups)]
        assert got == resident(self.mgr, self.num_groups)
        assert self.mirror.unknown_parents == 0

    def start(self, rid: str, tokens: list[int]) -> None:
        mgr = self.mgr
        mgr.add_request(Request(rid, tokens))
        res = mgr.lookup(rid)
        if mgr.allocate(rid, len(tokens) - res.hit, lookup=res) is None:
            mgr.finish(rid)
        else:
            step = mgr.seal_step()
            mgr.commit(step.step_id, {rid: (len(tokens), [5])})
            self.open[rid] = len(tokens) + 1
        self.sync()

    def decode(self, rid: str) -> None:
        mgr = self.mgr
        if mgr.allocate(rid, 1) is None:
            self.finish(rid)
            return
        step = mgr.seal_step()
        have = self.open[rid]
        mgr.commit(step.step_id, {rid: (have, [6 + have % 7])})
        self.open[rid] = have + 1
        self.sync()

    def finish(self, rid: str) -> None:
        self.mgr.finish(rid)
        del self.open[rid]
        self.sync()


op = st.tuples(st.sampled_from(["start", "decode", "finish"]), st.integers(0, 5), st.integers(0, 9))


@settings(max_examples=scaled(200))
@given(
    name=st.sampled_from(sorted(POOLS)),
    memo=st.sampled_from([1, 2, 8]),
    seed=st.integers(0, 2**16),
    ops=st.lists(op, min_size=1, max_size=60),
)
def test_the_mirror_holds_what_the_replica_holds(
    name: str, memo: int, seed: int, ops: list[tuple[str, int, int]]
) -> None:
    cfg = replace(GEOMETRIES[name], num_blocks=POOLS[name])
    # six prompts over two stems: a prompt repeats whenever its index is drawn again
    stems = [[(seed * 7 + s * 131 + i * 31) % 500 + 1 for i in range(90)] for s in range(2)]
    prompts = [stems[p % 2][: 20 + 13 * p] + [p + 600] * (p % 3) for p in range(6)]
    f = Followed(cfg, memo)
    for i, (what, p, k) in enumerate(ops):
        running = sorted(f.open)
        if what == "start" or not running:
            f.start(f"q{i}", prompts[p])
        elif what == "decode":
            for _ in range(k):
                rid = running[p % len(running)]
                if rid in f.open:
                    f.decode(rid)
        else:
            f.finish(running[p % len(running)])
    for rid in sorted(f.open):
        f.finish(rid)


@pytest.mark.parametrize("name", sorted(POOLS))
def test_a_long_repeated_history_keeps_every_boundary(name: str) -> None:
    """The same prompts over and over between others, far more stored blocks than the memo
    holds: the shared stem stays resident the whole time and never loses its boundary."""
    cfg = replace(GEOMETRIES[name], num_blocks=POOLS[name])
    f = Followed(cfg, memo=1)
    stem = [(i * 37) % 400 + 1 for i in range(48)]
    for i in range(60):
        f.start(f"a{i}", stem + [700 + i] * 9)
        f.decode(f"a{i}")
        f.finish(f"a{i}")
        f.start(f"b{i}", [(i * 13 + j) % 300 + 1 for j in range(30)])
        f.finish(f"b{i}")
    evicted = f.mgr.metrics()["kv_blocks_evicted_total"]
    assert evicted > 0  # the memo and the pool were both exceeded


def test_more_stored_blocks_than_any_fixed_memo() -> None:
    """A stem reused all along while 70,000 other blocks are stored and evicted around it (one
    token per unit, so each is a block on the wire): no bounded memo of the stored blocks can
    keep the stem's boundaries, the mirror must, since the replica holds the stem throughout."""
    cfg = CacheConfig(num_blocks=256, hash_unit=1, groups=[GroupSpec(kind="full", block_size=4)])
    f = Followed(cfg, memo=1)
    stem = [(i * 37) % 400 + 1 for i in range(32)]
    stored = 0
    i = 0
    while stored < 70_000:
        tokens = stem + [(i * 7919 + j * 104729) % 100_000 + 1 for j in range(96)]
        f.mgr.add_request(Request(f"q{i}", tokens))
        res = f.mgr.lookup(f"q{i}")
        assert i == 0 or res.hit >= 28  # the stem is still cached
        assert f.mgr.allocate(f"q{i}", len(tokens) - res.hit, lookup=res) is not None
        step = f.mgr.seal_step()
        f.mgr.commit(step.step_id, {f"q{i}": (len(tokens), [5])})
        f.mgr.finish(f"q{i}")
        wire = f.converter.convert(f.mgr.take_events())
        stored += sum(len(e.block_hashes) for e in wire if isinstance(e, BlockStored))
        f.mirror.apply(wire)
        i += 1
    assert f.mgr.metrics()["kv_blocks_evicted_total"] > 0
    got = [dict(f.mirror.entries(g)) for g in range(f.num_groups)]
    assert got == resident(f.mgr, f.num_groups)
    assert f.mirror.unknown_parents == 0
