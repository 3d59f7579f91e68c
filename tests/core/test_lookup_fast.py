"""The lookup's short cuts against the oracle, on key sets the request histories rarely build.

The full-attention probe stops at the first page whose full key is missing, and a pending key
matters to `pending_hit` only if a probe would read it (for full attention: the boundaries of
the page after the leading run). Driving the manager seldom makes an index with holes (a page
evicted while a later one stays) or pending keys right at that page, so these properties set
the index, the ghost record and the pending keys directly, then compare every bound, the
reason, the junction, `pending_bounds` and the slots with spec §15's oracle.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from depth import scaled
from kvreuse import CacheConfig, GroupSpec, KVCacheManager
from kvreuse.core import compute_lookup
from kvreuse.core.kinds import full
from kvreuse.core.pool import NULL
from kvreuse.oracle import OracleRequest, ident, oracle

KINDS = ["full", "full", "sliding", "recurrent"]


class View:
    """An IndexView over plain dicts and a ghost set."""

    def __init__(self, index: list[dict[bytes, int]], ghost: set[tuple[int, bytes]]) -> None:
        self.index = index
        self._ghost = ghost

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        return (group_id, key) in self._ghost


@st.composite
def cases(draw: st.DrawFn) -> tuple[CacheConfig, list[int], list[list[int]], bool, int]:
    unit = draw(st.sampled_from([1, 2, 4]))
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=3))
    groups = []
    for kind in kinds:
        size = unit * draw(st.sampled_from([1, 2, 4]))
        if kind == "sliding":
            groups.append(
                GroupSpec(kind="sliding", block_size=size, window=draw(st.integers(2, 20)))
            )
        else:
            groups.append(GroupSpec(kind=kind, block_size=size))
    cfg = CacheConfig(num_blocks=64, groups=groups, hash_unit=unit)
    tokens = draw(st.lists(st.integers(0, 3), min_size=1, max_size=48))
    # Per group and unit k ≥ 1: 0 absent, 1 resident, 2 pending, 3 evicted (ghost). A leading
    # run of resident units then anything, so holes above a long run are common.
    n = len(tokens) // unit
    run = draw(st.integers(0, n))
    states = [
        [1] * run + draw(st.lists(st.integers(0, 3), min_size=n - run, max_size=n - run))
        for _ in groups
    ]
    # how many pages the full-attention probe takes one by one before it probes in chunks
    first = draw(st.sampled_from([1, 2, full._FIRST]))
    return cfg, tokens, states, draw(st.booleans()), first


@settings(max_examples=scaled(300), deadline=2000)
@given(cases())
def test_lookup_matches_oracle_on_set_key_sets(
    case: tuple[CacheConfig, list[int], list[list[int]], bool, int],
) -> None:
    cfg, tokens, states, with_pending, first = case
    saved, full._FIRST = full._FIRST, first
    try:
        _check(cfg, tokens, states, with_pending)
    finally:
        full._FIRST = saved


def _check(
    cfg: CacheConfig, tokens: list[int], states: list[list[int]], with_pending: bool
) -> None:
    mgr = KVCacheManager(cfg)
    geo = mgr.geo
    chain = mgr.hasher.chain()
    chain.extend(tokens)
    hashes, u = chain.hashes, geo.hash_unit
    oreq = OracleRequest(tuple(tokens), len(tokens))
    index: list[dict[bytes, int]] = [{} for _ in geo.groups]
    pending: list[set[bytes]] = [set() for _ in geo.groups]
    ghost: set[tuple[int, bytes]] = set()
    entries, pending_entries, gone = set(), set(), set()
    block_id = 0
    for g, row in zip(geo.groups, states, strict=True):
        gid = g.group_id
        for k, state in enumerate(row[: chain.num_units], start=1):
            entry = (gid, k * u, ident(geo, oreq, k * u))
            if state == 1:
                block_id += 1
                index[gid][hashes[k]] = block_id
                entries.add(entry)
            elif state == 2 and with_pending:
                pending[gid].add(hashes[k])
                pending_entries.add(entry)
            elif state == 3:
                ghost.add((gid, hashes[k]))
                gone.add(entry)
    res = compute_lookup(
        geo, View(index, ghost), "r", chain, len(tokens), pending=pending if with_pending else None
    )
    truth = oracle(geo, oreq, entries, gone)
    assert (res.hit, res.reason, res.junction, res.bounds) == (
        truth.hit,
        truth.reason,
        truth.junction,
        truth.bounds,
    ), res.explain()
    assert res.pending_bounds == oracle(geo, oreq, entries | pending_entries).bounds
    for g in geo.groups:
        if g.kind != "full":
            continue
        B, k = g.page_size, g.page_size // u
        want = [index[g.group_id][hashes[(j + 1) * k]] for j in range(res.hit // B)]
        row = list(res.slots[g.group_id])
        assert row[: res.hit // B] == want
        if res.hit % B:
            src = max(
                b
                for b in range(res.hit, min(res.hit // B * B + B, chain.num_units * u) + 1, u)
                if hashes[b // u] in index[g.group_id]
            )
            assert row[-1] == res.copy_src[g.group_id] == index[g.group_id][hashes[src // u]]
        assert NULL not in row
