"""Read-only views of the manager: exports for routers and oracles, save positions, describe()."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvreuse.core.pool import NULL, BlockPool
from kvreuse.core.request import RequestState

if TYPE_CHECKING:
    from kvreuse.core.manager import KVCacheManager


def export_entries(pool: BlockPool) -> list[tuple[int, int, bytes, str, int]]:
    """(group_id, boundary, hash, kind, block_id) for every key of the index."""
    out = []
    for b in range(1, pool.num_blocks):
        if pool.has_keys(b):
            g = pool.group[b]
            out.extend((g, bd, h, pool.kind_of(g, bd), b) for bd, h in pool.key_list(b))
    out.sort(key=lambda e: (e[0], e[1], e[4]))
    return out


def export_ghost(pool: BlockPool) -> list[tuple[int, int, bytes]]:
    """(group_id, boundary, hash) for every key of the ghost record, oldest first."""
    return pool.ghost.entries()


def save_positions(
    mgr: KVCacheManager, st: RequestState, planned: dict[int, dict[int, str]], scheduled: int
) -> list[int]:
    """Positions above `scheduled` where the request still wants a state (spec §9.4)."""
    geo = mgr.geo
    if not geo.caching_enabled or not any(not g.is_attention for g in geo.groups):
        return []
    u, num = geo.hash_unit, len(st.tokens)
    want: set[int] = set()
    for g in geo.groups:
        if g.is_attention:
            continue
        want.update(c for c in planned.get(g.group_id, {}) if c > scheduled)
        if geo.dense_retention:
            M = g.page_size
            lo = max(scheduled, st.dense_from if st.phase.value == "running" else num)
            want.update(range(lo // M * M + M, num + 1, M))
    top = num // u * u
    want.update(c for c in (top - geo.kappa * u, top) if c > 0 and c > scheduled)
    return sorted(want)


def describe(mgr: KVCacheManager, st: RequestState | None) -> str:
    """Human-readable state (format not normative; tests must not parse it)."""
    pool, geo = mgr.pool, mgr.geo
    if st is None:
        m = mgr.metrics()
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
        f"request {st.request_id} [{st.phase.value}]: N = {len(st.tokens)}, "
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
    if st.phase.value == "running":
        lines.append(f"  save_positions {mgr.save_positions(st.request_id)}")
    return "\n".join(lines)
