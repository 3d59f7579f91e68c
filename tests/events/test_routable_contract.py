"""The routable mode against its contract, computed from scratch after every batch.

The contract (docs/events.md, "Modes"): the attention unit at boundary k is published while it,
or a unit below it, is routable, i.e. a request sharing the prefix up to k would reuse all k
tokens by the core's lookup (in drop mode: continuing along a resident child); a published unit
is retracted once that stops being true. The filter can only publish units whose tokens it has
seen: a unit is known from the attention `BlockStored` that carried it until it has left the
index and no known unit names it as parent.

`Contract` restates that with no cleverness: every group's index, the known units, and after
each batch the core's `compute_lookup` asked for every known unit. On random histories (chunked
prefill, decoding, two requests at once, pools small enough to evict, targeted evictions of
states and pages, resets, several steps per batch) the blocks a consumer holds after applying
the filter's wire events are exactly the contract's published units, with their parents and
tokens, and every event is one a consumer can apply (a parent before its child, no block
stored twice, no removal of a block it does not hold).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterable, Iterator
from dataclasses import replace
from datetime import timedelta

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from replica import GEOMETRIES as REPLICA_GEOMETRIES

from depth import scaled
from kvreuse.core import AllBlocksCleared as CoreCleared
from kvreuse.core import BlockStored as CoreStored
from kvreuse.core import (
    CacheConfig,
    Event,
    Geometry,
    GroupSpec,
    KVCacheManager,
    Request,
    compute_lookup,
)
from kvreuse.events import HashChain, hash64
from kvreuse.events.convert import Converter, attention_group
from kvreuse.events.routable import RoutableFilter
from kvreuse.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, WireEvent

GEOMETRIES: dict[str, CacheConfig] = {
    **REPLICA_GEOMETRIES,
    "attention-dcp4": CacheConfig(
        num_blocks=64, dcp_size=4, hash_unit=8, groups=[GroupSpec(kind="full", block_size=8)]
    ),
    "chunked-hybrid": CacheConfig(
        num_blocks=64,
        groups=[
            GroupSpec(kind="full", block_size=16),
            GroupSpec(kind="chunked", block_size=16, chunk=32),
            GroupSpec(kind="recurrent", block_size=16),
        ],
    ),
    "spec-drop-draft-first": CacheConfig(
        num_blocks=64,
        spec_mode="drop",
        groups=[
            GroupSpec(kind="full", block_size=16, role="draft"),
            GroupSpec(kind="sliding", block_size=16, window=40),
            GroupSpec(kind="full", block_size=16),
        ],
    ),
    "two-full": CacheConfig(
        num_blocks=64,
        hash_unit=16,
        groups=[GroupSpec(kind="full", block_size=16), GroupSpec(kind="full", block_size=32)],
    ),
}

Block = tuple[int | None, tuple[int, ...], tuple[int, ...]]  # parent, tokens, lookahead


class Contract:
    """What the routable mode must have published after each batch, from scratch."""

    def __init__(self, geo: Geometry) -> None:
        self.geo = geo
        self.gid = attention_group(geo).group_id
        self.index: list[dict[bytes, int]] = [{} for _ in geo.groups]
        self.parent: dict[bytes, bytes | None] = {}  # the known units
        self.content: dict[bytes, tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def reset(self) -> None:
        for idx in self.index:
            idx.clear()
        self.parent.clear()
        self.content.clear()

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        return False

    def apply(self, events: Iterable[Event]) -> set[bytes]:
        cacheable = {g.group_id for g in self.geo.cacheable}
        for ev in events:
            if isinstance(ev, CoreCleared):
                self.reset()
            elif ev.group_id not in cacheable:
                continue
            elif isinstance(ev, CoreStored):
                self._stored(ev)
            else:
                self.index[ev.group_id].pop(ev.hash, None)
                h: bytes | None = ev.hash
                while ev.group_id == self.gid and h in self.parent and not self._held(h):
                    p = self.parent.pop(h)
                    del self.content[h]
                    h = p
        return {x for h in self.parent if self.routable(h) for x in self.path(h)[1:]}

    def _held(self, h: bytes) -> bool:
        return h in self.index[self.gid] or h in self.parent.values()

    def _stored(self, ev: CoreStored) -> None:
        u, start = self.geo.hash_unit, ev.token_start
        for k, e in enumerate(ev.entries):
            self.index[ev.group_id][e.hash] = e.boundary
            if ev.group_id == self.gid:
                at = (e.boundary - start) // u
                self.parent[e.hash] = ev.unit_hashes[at - 1] if e.boundary > u else None
                tokens = ev.token_ids[e.boundary - u - start : e.boundary - start]
                self.content[e.hash] = (tokens, ev.successor_token_ids[k])

    def path(self, h: bytes) -> list[bytes]:
        """[H[0], …, h] through known units ([] when the way back is not known)."""
        path: list[bytes] = [h]
        while (p := self.parent[path[-1]]) is not None:
            if p not in self.parent:
                return []
            path.append(p)
        return [b"", *reversed(path)]

    def routable(self, h: bytes) -> bool:
        path = self.path(h)
        if h not in self.index[self.gid] or not path:
            return False
        boundary = (len(path) - 1) * self.geo.hash_unit
        if self.geo.spec_mode != "drop":
            return self.hit(path) == boundary
        resident = [c for c, p in self.parent.items() if p == h and c in self.index[self.gid]]
        return any(self.hit([*path, c]) >= boundary for c in resident)

    def hit(self, chain: list[bytes]) -> int:
        num_tokens = (len(chain) - 1) * self.geo.hash_unit + 1
        return compute_lookup(self.geo, self, "contract", HashChain(chain), num_tokens).hit

    def blocks(self, published: set[bytes]) -> dict[int, Block]:
        return {
            hash64(h): (
                None if (p := self.parent[h]) is None else hash64(p),
                *self.content[h],
            )
            for h in published
        }


def apply_wire(held: dict[int, Block], wire: list[WireEvent], geo: Geometry, gid: int) -> None:
    """A consumer of one attention group: applies events, failing on one it could not apply."""
    u = geo.hash_unit
    for e in wire:
        if isinstance(e, AllBlocksCleared):
            held.clear()
        elif isinstance(e, BlockRemoved):
            assert e.group_idx == gid
            for h in e.block_hashes:
                assert h in held, "a removal of a block the consumer does not hold"
                del held[h]
        else:
            assert isinstance(e, BlockStored)
            assert (e.group_idx, e.block_size, e.kv_cache_spec_kind) == (gid, u, "full_attention")
            assert len(e.token_ids) == u * len(e.block_hashes)
            parent = e.parent_block_hash
            assert parent is None or parent in held, "a block stored before its parent"
            for i, h in enumerate(e.block_hashes):
                assert h not in held, "a block stored twice"
                ahead = tuple(e.lookahead_token_ids[i]) if e.lookahead_token_ids else ()
                held[h] = (parent, tuple(e.token_ids[i * u : (i + 1) * u]), ahead)
                parent = h


class History:
    """A manager driven step by step; its events go to the filter and to the contract."""

    def __init__(self, cfg: CacheConfig, flushes: Iterator[bool]) -> None:
        self.cfg, self.geo = cfg, cfg.geometry
        self.mgr = KVCacheManager(cfg)
        self.filter = RoutableFilter(self.geo)
        self.contract = Contract(self.geo)
        self.groups = Converter(self.geo, [self.filter.gid])
        self.held: dict[int, Block] = {}
        self.pending: list[Event] = []
        self.flushes = flushes
        self.num_filtered = 0  # batches where routable held less than the attention index
        self.most_held = 0

    def step_done(self, flush: bool = False) -> None:
        self.pending += self.mgr.take_events()
        if next(self.flushes) or flush:
            events, self.pending = self.pending, []
            apply_wire(self.held, self.filter.convert(events), self.geo, self.filter.gid)
            published = self.contract.apply(events)
            assert self.held == self.contract.blocks(published)
            self.most_held = max(self.most_held, len(self.held))
            self.num_filtered += len(published) < len(self.contract.index[self.filter.gid])

    def play(self, jobs: list[tuple[str, list[int], int, int]]) -> None:
        """Run requests (id, prompt, prefill chunk or 0 for all, tokens to decode) together."""
        mgr, live = self.mgr, {}
        for rid, tokens, chunk, decode in jobs:
            mgr.add_request(Request(rid, tokens))
            res = mgr.lookup(rid)
            n = len(tokens) - res.hit
            if mgr.allocate(rid, min(chunk or n, n), lookup=res) is None:
                mgr.finish(rid)
                continue
            live[rid] = [len(tokens), res.hit + min(chunk or n, n), decode, chunk]
        while live:
            step = mgr.seal_step()
            outcomes = {}
            for rid, (prompt, end, _, _) in live.items():
                outcomes[rid] = (end, [6 + end % 7] if end >= prompt else [])
            mgr.commit(step.step_id, outcomes)
            for rid, state in list(live.items()):
                prompt, end, decode, chunk = state
                if end < prompt:
                    n = min(chunk, prompt - end)
                elif decode:
                    n, state[2], state[0] = 1, decode - 1, end + 1  # decodes the sampled token
                else:
                    n = 0
                if not n or mgr.allocate(rid, n) is None:
                    mgr.finish(rid)
                    del live[rid]
                else:
                    state[1] = end + n
            self.step_done()
        self.step_done()

    def evict(self, rng: random.Random, num: int) -> None:
        """Targeted evictions of resident blocks no request uses (states among them)."""
        entries = self.mgr.export_entries()
        for _ in range(num if entries else 0):
            with contextlib.suppress(ValueError):  # in use, or evicted already
                self.mgr.evict(rng.choice(entries)[4])
        self.step_done()


job = st.tuples(
    st.integers(0, 2),  # stem
    st.integers(0, 100),  # percent of the stem kept
    st.integers(0, 30),  # new tokens after it
    st.sampled_from([0, 0, 7, 19]),  # prefill chunk (0: the whole prompt at once)
    st.integers(0, 6),  # tokens decoded
    st.booleans(),  # runs together with the next job
    st.integers(0, 3),  # targeted evictions after it
)


def play_history(
    name: str, num_blocks: int, dense: bool, seed: int, jobs: list[tuple], flushes: Iterator[bool]
) -> History:
    cfg = replace(
        GEOMETRIES[name],
        num_blocks=num_blocks,
        recurrent_retention="dense" if dense else "sparse",
    )
    history = History(cfg, flushes)
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 300) for _ in range(rng.randrange(30, 130))] for _ in range(3)]
    group: list[tuple[str, list[int], int, int]] = []
    for i, (stem, share, extra, chunk, decode, together, evictions) in enumerate(jobs):
        tokens = stems[stem][: max(1, len(stems[stem]) * share // 100)]
        tokens = tokens + [rng.randrange(1, 300) for _ in range(extra)]
        group.append((f"q{i}", tokens, chunk, decode))
        if not together or len(group) == 2:
            history.play(group)
            group = []
            history.evict(rng, evictions)
            if rng.random() < 0.05:
                history.mgr.reset()
                history.step_done()
    history.play(group)
    history.step_done(flush=True)
    return history


@settings(max_examples=scaled(300), deadline=timedelta(seconds=30))
@example(  # two full-attention groups: a page the second one evicted stops the reuse
    name="two-full",
    num_blocks=24,
    dense=False,
    seed=11651,
    jobs=[
        (0, 0, 0, 0, 0, False, 3),
        (1, 0, 2, 0, 0, False, 0),
        (0, 0, 9, 19, 6, False, 3),
        (2, 15, 30, 19, 6, False, 3),
        (2, 0, 26, 0, 6, False, 3),
        (2, 31, 30, 19, 6, False, 3),
        (2, 0, 3, 0, 2, False, 1),
        (2, 0, 0, 0, 0, False, 0),
        *[(0, 0, 0, 0, 0, False, 0)] * 2,
        (2, 0, 3, 0, 6, False, 3),
        (2, 4, 30, 19, 6, False, 3),
    ],
    flushes=[False],
)
@example(  # a unit out of the index that still names a branch, above a chain being forgotten
    name="attention-dcp4",
    num_blocks=24,
    dense=False,
    seed=29863,
    jobs=[
        *[(0, 0, 0, 0, 0, False, 0)] * 4,
        (0, 45, 2, 0, 0, False, 1),
        *[(0, 0, 0, 0, 0, False, 0)] * 5,
        (0, 35, 2, 0, 4, False, 0),
        (0, 0, 0, 0, 0, False, 2),
        (0, 27, 0, 0, 0, False, 0),
    ],
    flushes=[False],
)
@given(
    name=st.sampled_from(sorted(GEOMETRIES)),
    num_blocks=st.sampled_from([24, 40, 64, 256]),
    dense=st.booleans(),
    seed=st.integers(0, 2**16),
    jobs=st.lists(job, min_size=1, max_size=20),
    flushes=st.lists(st.booleans(), min_size=1, max_size=8),
)
def test_routable_publishes_exactly_the_contract(
    name: str, num_blocks: int, dense: bool, seed: int, jobs: list[tuple], flushes: list[bool]
) -> None:
    cycle = iter(lambda: None, 0)  # endless
    flags = (flushes[i % len(flushes)] or i % 4 == 3 for i, _ in enumerate(cycle))
    play_history(name, num_blocks, dense, seed, jobs, flags)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_the_contract_check_is_not_vacuous(name: str) -> None:
    """A fixed history on each geometry evicts, publishes, and on the hybrids publishes less
    than the attention index holds (so a filter that published the index would fail)."""
    rng = random.Random(name)
    jobs = [
        (rng.randrange(3), rng.randrange(101), rng.randrange(31), 0, rng.randrange(7), False, 2)
        for _ in range(24)
    ]
    history = play_history(name, 40, False, 7, jobs, iter(lambda: True, False))
    assert history.mgr.metrics()["kv_blocks_evicted_total"] > 0
    assert history.most_held > 0
    if name not in ("attention", "attention-dcp4", "two-full"):
        assert history.num_filtered > 0
