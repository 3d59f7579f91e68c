"""Allocation (spec §9): admission with a hit, growth of a running request, checkpoint saves.

Admission of a request with hit h computing [h, e), attention page size B:

    pages     0 .. ⌊h/B⌋−1          p(h) (if h mod B ≠ 0)      ⌈h/B⌉ .. ⌈(e+s)/B⌉−1
    slot      shared hit (or NULL)  fresh D + Copy(src → D)    fresh
              adopt: ref +1         src adopted until commit

Everything is counted first (`required`, 9.5); only when it fits are references taken, in the
order adopt → pop fresh → pop saves, so a fresh pop never evicts a block this admission reuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvreuse.core.lookup import LookupResult, needed_from
from kvreuse.core.plan import Copy, RecurrentSlot, RequestPlan, Save
from kvreuse.core.pool import NULL
from kvreuse.core.request import RecurrentSlots, RequestState

if TYPE_CHECKING:
    from kvreuse.core.config import Geometry, GroupGeometry
    from kvreuse.core.manager import KVCacheManager

_ORDER = {"rolling": 0, "replay": 1, "junction": 2, "dense": 3}


@dataclass(eq=False, slots=True)
class PlanRecord:
    """The manager's side of one RequestPlan: what its commit must settle."""

    req: RequestState
    plan: RequestPlan
    saves: list[tuple[int, int, int, bool, bool]]  # (group, position, block, rolling, planned)
    copies: list[Copy]
    # The step's [start, end), kept here: the manager never trusts a plan it handed out.
    start: int = 0
    end: int = 0
    step_id: int = -1
    withdrawn: bool = False
    keys: list[tuple[int, bytes]] | None = None  # pending_keys, valid while `keys_at` holds
    keys_at: tuple[int, int] = (-1, -1)  # (req.committed, req.chain.num_units) when computed


# ---------------------------------------------------------------------------- save planning
def replay_point(geo: Geometry, prompt_len: int) -> int:
    """ρ(P): the hit of an identical resend when every entry is resident (spec §8)."""
    u = geo.hash_unit
    if geo.spec_mode == "drop":
        return max(0, prompt_len // u * u - u)
    return max(0, (prompt_len - max(geo.lookahead, 1)) // u * u)


def planned_positions(
    geo: Geometry,
    mgr: KVCacheManager,
    req: RequestState,
    g: GroupGeometry,
    hit: int,
    junction: int | None,
) -> dict[int, str]:
    """Positions a recurrent group plans at admission (9.4), purpose by first category."""
    u, M, S = geo.hash_unit, g.page_size, geo.common_page
    nu = req.chain.num_units * u
    candidates: list[tuple[int, str]] = []
    rho = replay_point(geo, req.prompt_len)
    candidates += [(rho, "replay"), (rho // M * M, "replay"), (rho // S * S, "replay")]
    if junction is not None:
        candidates += [
            (junction, "junction"),
            (junction // M * M, "junction"),
            (junction // S * S, "junction"),
        ]
    if geo.dense_retention:
        candidates += [(c, "dense") for c in range(hit // M * M + M, nu + 1, M)]
    out: dict[int, str] = {}
    idx = mgr.pool.index[g.group_id]
    hashes = req.chain.hashes
    for c, why in candidates:
        valid = hit < c <= nu and c % u == 0 and hashes[c // u] not in idx
        if valid and (c not in out or _ORDER[why] < _ORDER[out[c]]):
            out[c] = why
    return out


def step_saves(
    geo: Geometry,
    req: RequestState,
    g: GroupGeometry,
    start: int,
    end: int,
    planned: dict[int, str],
) -> list[tuple[int, str, bool]]:
    """Saves of one step in pop order: (position, first purpose, also planned)."""
    u = geo.hash_unit
    decode = start >= len(req.tokens) - 1 and start > 0
    if decode and end // u == start // u and not any(start < c <= end for c in planned):
        return []  # most decode steps: no unit boundary, nothing planned in (start, end]
    floor = start + 1 if decode else max(start + 1, end // u * u - geo.kappa * u)
    rolling = {c for c in range(-(-floor // u) * u, end + 1, u) if c > start}
    chosen: dict[int, str] = {c: "rolling" for c in rolling}
    for c, why in planned.items():
        if start < c <= end and c not in chosen:
            chosen[c] = why
    return sorted(
        ((c, why, c in planned) for c, why in chosen.items()), key=lambda t: (_ORDER[t[1]], t[0])
    )


def add_dense(
    geo: Geometry, mgr: KVCacheManager, req: RequestState, g: GroupGeometry, start: int, end: int
) -> None:
    """Dense retention: multiples of M computed above the admission's hashed length (9.4)."""
    if not geo.dense_retention:
        return
    M, u = g.page_size, geo.hash_unit
    planned = req.planned[g.group_id]
    idx, hashes, nu = mgr.pool.index[g.group_id], req.chain.hashes, req.chain.num_units * u
    lo = max(start, req.dense_from)
    for c in range(lo // M * M + M, end + 1, M):
        if c in planned:
            continue
        if c <= nu and hashes[c // u] in idx:
            continue
        planned[c] = "dense"


# ---------------------------------------------------------------------------- counting
def hit_blocks(res: LookupResult) -> list[int]:
    """Every block a hit reuses: shared pages, copy sources, recurrent sources."""
    blocks = [b for row in res.slots.values() for b in row if b != NULL]
    blocks += [b for b in res.state_src.values() if b is not None]
    return blocks


def admission_required(
    geo: Geometry,
    mgr: KVCacheManager,
    res: LookupResult,
    end: int,
    extra: int,
    hits: list[int] | None = None,
) -> int:
    h = res.hit
    required = 0
    for g in geo.groups:
        if g.is_attention:
            B = g.page_size
            total = -(-(end + extra) // B)
            if g.cacheable:
                copy = 1 if h % B and needed_from(g, h) <= h // B else 0
                required += total - (-(-h // B)) + copy
            else:
                required += total - h // B
        else:
            required += 1 + g.scratch
    ref = mgr.pool.ref
    hits = hit_blocks(res) if hits is None else hits
    required += sum(1 for b in set(hits) if ref[b] == 0)
    return required


def growth_pages(geo: Geometry, req: RequestState, end: int, extra: int) -> list[tuple[int, int]]:
    """(group, fresh pages) for every attention group a growth to [.., end + s) must extend."""
    out, tables = [], req.tables
    for g in geo.groups:  # a plain loop: this runs once per request per step
        if g.is_attention:
            n = -(-(end + extra) // g.page_size) - len(tables[g.group_id])
            if n > 0:
                out.append((g.group_id, n))
    return out


def growth_required(geo: Geometry, req: RequestState, end: int, extra: int) -> int:
    return sum(n for _, n in growth_pages(geo, req, end, extra))


# ---------------------------------------------------------------------------- admission
def admit(
    mgr: KVCacheManager,
    req: RequestState,
    res: LookupResult,
    num_new: int,
    extra: int,
    hits: list[int],
) -> PlanRecord:
    """Take the references of an admission that is known to fit (9.5 steps 1–3)."""
    geo, pool = mgr.geo, mgr.pool
    h, end = res.hit, res.hit + num_new
    # 0. fix the planned checkpoint positions on the index the lookup saw (before any pop can
    #    evict), so they equal what save_positions(req, lookup) reported.
    req.planned = {}
    if geo.caching_enabled:
        for g in geo.groups:
            if not g.is_attention:
                req.planned[g.group_id] = planned_positions(geo, mgr, req, g, h, res.junction)
    # 1. adopt every hit block (shared pages, copy sources, recurrent sources).
    pool.adopt_many(hits)
    tables: dict[int, list[int]] = {}
    new_blocks: dict[int, list[int]] = {}
    copies: list[Copy] = []
    rec: dict[int, RecurrentSlot] = {}
    # 2. pop fresh blocks, groups ascending, slots in table order.
    for g in geo.groups:
        gid = g.group_id
        if g.is_attention:
            B = g.page_size
            if g.cacheable:
                row = list(res.slots.get(gid, ()))
                first_fresh = len(row)
                src = res.copy_src.get(gid)
                if src is not None:
                    dst = pool.pop(gid)
                    row[-1] = dst
                    pool.adopt(dst)  # the pending copy's reference
                    copies.append(Copy(gid, src, dst))
                    first_fresh -= 1
            else:
                row = [NULL] * (h // B)
                first_fresh = len(row)
            row.extend(pool.pop_many(gid, -(-(end + extra) // B) - len(row)))
            tables[gid] = row
            new_blocks[gid] = row[first_fresh:]
        else:
            live = pool.pop(gid)
            scratch = [pool.pop(gid) for _ in range(g.scratch)]
            src = res.state_src.get(gid)
            if src is not None:
                pool.adopt(live)
                copies.append(Copy(gid, src, live))
            req.recurrent[gid] = RecurrentSlots(live, scratch, {})
            rec[gid] = RecurrentSlot(live, tuple(scratch), "copy" if src is not None else "zero")
            new_blocks[gid] = [live, *scratch]
    req.tables = tables
    req.plan_parts = None
    req.window_lo = {}
    req.hit = h
    req.committed = h
    req.scheduled = end
    req.processed = {
        gid: h // geo.groups[gid].page_size * geo.groups[gid].page_size for gid in tables
    }
    req.published_states = {g.group_id: [] for g in geo.groups if not g.is_attention}
    req.dense_from = req.chain.num_units * geo.hash_unit
    # 3. saves, best effort.
    saves = _pop_saves(mgr, req, h, end)
    plan = RequestPlan(
        req.request_id,
        h,
        num_new,
        extra,
        {k: list(v) for k, v in tables.items()},
        rec,
        new_blocks,
        copies,
        [Save(g, c, b) for g, c, b, _, _ in saves],
        hit=h,
        is_admission=True,
    )
    return PlanRecord(req, plan, saves, copies, h, end)


def grow(
    mgr: KVCacheManager, req: RequestState, num_new: int, extra: int, free: int
) -> PlanRecord | None:
    """Append fresh pages for [start, end + s) and plan this step's saves (9.6); None, with
    nothing changed, when the fresh pages exceed `free`."""
    geo, pool = mgr.geo, mgr.pool
    start = req.scheduled
    end = start + num_new
    pages = growth_pages(geo, req, end, extra)
    new_blocks: dict[int, list[int]] | None = None
    if pages:  # most decode steps need no page
        if sum(n for _, n in pages) > free:
            return None
        new_blocks = {gid: [] for gid in req.tables}
        for gid, n in pages:
            new_blocks[gid] = fresh = pool.pop_many(gid, n)
            req.tables[gid].extend(fresh)
    parts = req.plan_parts
    if new_blocks is not None or parts is None:
        # The plan's tables are a copy (plans are snapshots); while no page changes, every
        # growth plan shares one copy, rebuilt only when a page is added or freed.
        rec: dict[int, RecurrentSlot] = {}
        for g in geo.recurrent:
            slots = req.recurrent[g.group_id]  # live and scratch stay fixed while it runs
            rec[g.group_id] = RecurrentSlot(slots.live, tuple(slots.scratch), "keep")
        empty = {g.group_id: [] for g in geo.groups}
        req.plan_parts = parts = ({k: list(v) for k, v in req.tables.items()}, rec, empty)
        if new_blocks is not None:
            new_blocks = {**empty, **new_blocks}
    req.scheduled = end
    saves = _pop_saves(mgr, req, start, end) if geo.recurrent else []
    plan = RequestPlan(
        req.request_id,
        start,
        num_new,
        extra,
        parts[0],
        parts[1],
        parts[2] if new_blocks is None else new_blocks,
        [],
        [Save(g, c, b) for g, c, b, _, _ in saves] if saves else [],
    )
    return PlanRecord(req, plan, saves, [], start, end)


def _pop_saves(
    mgr: KVCacheManager, req: RequestState, start: int, end: int
) -> list[tuple[int, int, int, bool, bool]]:
    geo, pool = mgr.geo, mgr.pool
    if not geo.caching_enabled:
        return []
    u = geo.hash_unit
    # A decode step within one unit: no rolling save, and (pages being multiples of u) no
    # dense position; only a planned position in (start, end] could still be due.
    if (
        start > 0
        and start >= len(req.tokens) - 1
        and end // u == start // u
        and not any(start < c <= end for planned in req.planned.values() for c in planned)
    ):
        return []
    out: list[tuple[int, int, int, bool, bool]] = []
    for g in geo.recurrent:
        add_dense(geo, mgr, req, g, start, end)
        for c, why, planned in step_saves(geo, req, g, start, end, req.planned[g.group_id]):
            if not len(pool.policy):
                mgr.counters["saves_skipped"] += 1
                continue
            out.append((g.group_id, c, pool.pop(g.group_id), why == "rolling", planned))
    return out
