"""Read-only views of the pool and a request: exports for routers and oracles, describe()."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvreuse.core.config import Geometry
from kvreuse.core.pool import NULL, BlockPool
from kvreuse.core.request import Phase, RequestState


def export_entries(pool: BlockPool) -> list[tuple[int, int, bytes, str, int]]:
    """(group_id, boundary, hash, kind, block_id) for every key of the index."""
    out: list[tuple[int, int, bytes, str, int]] = []
    for b in range(1, pool.num_blocks):
        if pool.has_keys(b):
            gid = pool.group[b]
            out.extend((gid, bd, h, pool.kind_of(gid, bd), b) for bd, h in pool.key_list(b))
    out.sort(key=lambda e: (e[0], e[1], e[4]))
    return out


def export_ghost(pool: BlockPool) -> list[tuple[int, int, bytes]]:
    """(group_id, boundary, hash) for every key of the ghost record, oldest first."""
    return pool.ghost.entries()


def describe(
    geo: Geometry,
    pool: BlockPool,
    m: Mapping[str, Any],
    st: RequestState | None,
    wanted: Sequence[int],
) -> str:
    """Human-readable state of the pool (`st` None, `m` its metrics) or of one request and the
    save positions it still wants (format not normative; tests must not parse it)."""
    if st is None:
        lines = [
            f"pool: {pool.num_blocks - 1} blocks (+ null), u = {geo.hash_unit}, "
            f"L = {geo.lookahead}, spec mode {geo.spec_mode}",
            f"  in use {m['kv_blocks_in_use']}, cached {m['kv_blocks_cached']}, "
            f"free {m['kv_blocks_free']}, usage {m['kv_usage']:.1%}",
            f"  index entries {m['kv_index_entries']}, ghost keys {m['kv_ghost_keys']}",
        ]
        for g in geo.groups:
            lines.append(f"  {g.describe()}{'' if g.cacheable else ' [not cacheable]'}")
        return "\n".join(lines)
    u = geo.hash_unit
    lines = [
        f"request {st.request_id} [{st.phase}]: N = {len(st.tokens)}, "
        f"n = {st.chain.num_units} units ({st.chain.num_units * u} tokens hashed), "
        f"T = {st.committed}, scheduled = {st.scheduled}, hit = {st.hit}",
    ]
    for gid, row in sorted(st.tables.items()):
        shown = " ".join("NULL" if b == NULL else str(b) for b in row)
        lines.append(f"  group {gid} table: [{shown}]")
    for gid, slots in sorted(st.recurrent.items()):
        lines.append(
            f"  group {gid} live {slots.live} scratch {slots.scratch} held "
            f"{dict(sorted(slots.held.items()))} planned {sorted(st.planned.get(gid, {}))}"
        )
    if st.phase is Phase.RUNNING:
        lines.append(f"  save_positions {list(wanted)}")
    return "\n".join(lines)
