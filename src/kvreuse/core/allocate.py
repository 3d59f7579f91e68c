"""Allocation (spec §9): admission with a hit, growth of a running request, checkpoint saves.

Admission of a request with hit h computing [h, e), attention page size B:

    pages     0 .. ⌊h/B⌋−1          p(h) (if h mod B ≠ 0)      ⌈h/B⌉ .. ⌈(e+s)/B⌉−1
    slot      shared hit (or NULL)  fresh D + Copy(src → D)    fresh
              adopt: ref +1         src adopted until commit

Everything is counted first (`required`, 9.5); only when it fits are references taken, in the
order adopt → pop fresh → pop saves, so a fresh pop never evicts a block this admission reuses.
"""

from __future__ import annotations

from operator import itemgetter

from kvreuse.core.config import Geometry
from kvreuse.core.ledger import PlannedSave, PlanRecord
from kvreuse.core.lookup import LookupResult
from kvreuse.core.metrics import CacheStats
from kvreuse.core.plan import Copy, RecurrentSlot, RequestPlan, Save
from kvreuse.core.pool import NULL, BlockPool
from kvreuse.core.request import PlanParts, RecurrentSlots, RequestState, SavePurpose
from kvreuse.core.savepoints import (
    dense_positions,
    is_quiet_decode,
    planned_positions,
    step_saves,
)

NO_PAGE_LIMIT = 1 << 62  # `PlanParts.room` of a model without an attention group


# ---------------------------------------------------------------------------- counting
def hit_blocks(res: LookupResult) -> list[int]:
    """Every block a hit reuses: shared pages, copy sources, recurrent sources."""
    blocks: list[int] = []
    for row in res.slots.values():
        blocks += filter(None, row)  # NULL is 0: the pages a window no longer needs
    blocks += [b for b in res.state_src.values() if b is not None]
    return blocks


def admission_required(
    geo: Geometry, pool: BlockPool, res: LookupResult, end: int, extra: int, hits: list[int]
) -> int:
    """The fresh blocks an admission needs (9.5): pages above the hit, a copy destination for
    a partial hit page, a live state (and scratch) per recurrent group, and every hit block
    that now sits in the free queue (adopting it takes it out)."""
    h, top = res.hit, end + extra
    required = 0
    for g in geo.groups:
        required += g.admission_blocks(h, top)
    # the hit blocks with no reference (in the free queue), each counted once; itemgetter
    # reads the counts in one C loop (a tuple when given two or more items)
    distinct = set(hits)
    if len(distinct) > 1:
        return required + itemgetter(*distinct)(pool.ref).count(0)
    return required + sum(1 for b in distinct if pool.ref[b] == 0)


def growth_pages(geo: Geometry, req: RequestState, end: int, extra: int) -> list[tuple[int, int]]:
    """(gid, fresh pages) for every attention group a growth to [.., end + s) must extend."""
    out, tables = [], req.tables
    for g in geo.paged:  # a plain loop: this runs once per request per step
        n = -(-(end + extra) // g.page_size) - len(tables[g.group_id])
        if n > 0:
            out.append((g.group_id, n))
    return out


def growth_required(geo: Geometry, req: RequestState, end: int, extra: int) -> int:
    return sum(n for _, n in growth_pages(geo, req, end, extra))


# ---------------------------------------------------------------------------- admission
def admit(
    geo: Geometry,
    pool: BlockPool,
    stats: CacheStats,
    req: RequestState,
    res: LookupResult,
    num_new: int,
    extra: int,
    hits: list[int],
) -> PlanRecord:
    """Take the references of an admission that is known to fit (9.5 steps 1–3)."""
    h, end = res.hit, res.hit + num_new
    # 0. fix the planned checkpoint positions on the index the lookup saw (before any pop can
    #    evict), so they equal what save_positions(req, lookup) reported.
    planned = {}
    if geo.caching_enabled:
        for g in geo.recurrent:
            keys = pool.index[g.group_id]
            planned[g.group_id] = planned_positions(geo, req, g, h, res.junction, keys)
    # 1. adopt every hit block (shared pages, copy sources, recurrent sources).
    pool.adopt_many(hits)
    # 2. pop fresh blocks, groups ascending, slots in table order.
    tables, new_blocks, copies, rec, slots = _pop_admission(geo, pool, res, end + extra)
    processed = {gid: h // geo.groups[gid].page_size * geo.groups[gid].page_size for gid in tables}
    req.admit(tables, slots, h, processed, planned, req.chain.num_units * geo.hash_unit)
    # 3. saves, best effort.
    saves = _pop_saves(geo, pool, stats, req, h, end)
    plan = RequestPlan(
        request_id=req.request_id,
        start=h,
        num_new_tokens=num_new,
        num_extra_slots=extra,
        tables={k: list(v) for k, v in tables.items()},
        recurrent=rec,
        new_blocks=new_blocks,
        copies=copies,
        saves=[Save(s.gid, s.position, s.block_id) for s in saves],
        hit=h,
        is_admission=True,
    )
    return PlanRecord(req, plan, saves, copies, h, end)


def _pop_admission(
    geo: Geometry, pool: BlockPool, res: LookupResult, top: int
) -> tuple[
    dict[int, list[int]],
    dict[int, list[int]],
    list[Copy],
    dict[int, RecurrentSlot],
    dict[int, RecurrentSlots],
]:
    """Fresh blocks of an admission covering [0, top): (tables, new blocks, copies, the
    plan's states, the request's states)."""
    h = res.hit
    tables: dict[int, list[int]] = {}
    new_blocks: dict[int, list[int]] = {}
    copies: list[Copy] = []
    rec: dict[int, RecurrentSlot] = {}
    slots: dict[int, RecurrentSlots] = {}
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
            row.extend(pool.pop_many(gid, -(-top // B) - len(row)))
            tables[gid] = row
            new_blocks[gid] = row[first_fresh:]
        else:
            live = pool.pop(gid)
            scratch = [pool.pop(gid) for _ in range(g.scratch)]
            src = res.state_src.get(gid)
            if src is not None:
                pool.adopt(live)
                copies.append(Copy(gid, src, live))
            slots[gid] = RecurrentSlots(live, scratch, {})
            rec[gid] = RecurrentSlot(live, tuple(scratch), "copy" if src is not None else "zero")
            new_blocks[gid] = [live, *scratch]
    return tables, new_blocks, copies, rec, slots


# ---------------------------------------------------------------------------- growth
def grow(
    geo: Geometry,
    pool: BlockPool,
    stats: CacheStats,
    req: RequestState,
    num_new: int,
    extra: int,
) -> PlanRecord | None:
    """Append fresh pages for [start, end + s) and plan this step's saves (9.6); None, with
    nothing changed, when the fresh pages exceed the free blocks. (The ledger's `add` moves
    the request's scheduled end to the plan's.)

    The plan's tables are a copy (plans are snapshots); while no page changes, every growth
    plan of the request shares one copy (`PlanParts`, dropped by the request when its tables
    change). A growth within its `room` adds no page, so most decode steps take the kept
    parts as they are: no page is counted, popped or copied."""
    start = req.scheduled
    end = start + num_new
    parts = req.plan_parts
    new_blocks: dict[int, list[int]] | None = None
    if parts is None or end + extra > parts.room:
        pages = growth_pages(geo, req, end, extra)
        if pages:
            if sum(n for _, n in pages) > pool.num_free:
                return None
            new_blocks = {gid: [] for gid in req.tables}
            for gid, n in pages:
                new_blocks[gid] = fresh = pool.pop_many(gid, n)
                req.add_pages(gid, fresh)
        parts = req.plan_parts
        if parts is None:
            parts = _plan_parts(geo, req)
            req.keep_plan_parts(parts)
        if new_blocks is not None:
            new_blocks = {**parts.new_blocks, **new_blocks}
    saves: list[PlannedSave] = []
    # A quiet decode step (most of them) owes no save: checked here to skip a call per step.
    if geo.recurrent and geo.caching_enabled and not is_quiet_decode(geo, req, start, end):
        saves = _pop_saves(geo, pool, stats, req, start, end)
    tables, recurrent, no_blocks, _ = parts
    plan = RequestPlan(  # positional: this runs once per request per decode step
        req.request_id,
        start,
        num_new,
        extra,
        tables,
        recurrent,
        no_blocks if new_blocks is None else new_blocks,
        [],
        [Save(s.gid, s.position, s.block_id) for s in saves] if saves else [],
    )
    record = PlanRecord(req, plan, saves, [], start, end)
    u = geo.hash_unit
    # the keys it would publish lie in (⌊T/u⌋·u, E]: none when no boundary is crossed and T is
    # where this plan starts (nothing else of the request in flight)
    record.quiet = (
        not saves and start // u == end // u and start == req.committed and not req.inflight
    )
    return record


def _plan_parts(geo: Geometry, req: RequestState) -> PlanParts:
    """What every growth plan repeats while no page changes: a copy of the tables, the
    recurrent slots (live and scratch stay fixed while the request runs), no new blocks, and
    the tokens the tables cover."""
    rec: dict[int, RecurrentSlot] = {}
    for g in geo.recurrent:
        slots = req.recurrent[g.group_id]
        rec[g.group_id] = RecurrentSlot(slots.live, tuple(slots.scratch), "keep")
    empty: dict[int, list[int]] = {g.group_id: [] for g in geo.groups}
    tables = {k: list(v) for k, v in req.tables.items()}
    room = min((len(tables[g.group_id]) * g.page_size for g in geo.paged), default=NO_PAGE_LIMIT)
    return PlanParts(tables, rec, empty, room)


def _pop_saves(
    geo: Geometry, pool: BlockPool, stats: CacheStats, req: RequestState, start: int, end: int
) -> list[PlannedSave]:
    """Pop a block per save of the step, best effort: a save the pool cannot serve is skipped
    (counted), never a reason to refuse the step."""
    if not geo.caching_enabled:
        return []  # (growth checks is_quiet_decode before calling)
    out: list[PlannedSave] = []
    for g in geo.recurrent:
        gid = g.group_id
        dense = dense_positions(geo, req, g, start, end, pool.index[gid])
        if dense:
            req.plan_dense(gid, dense)
        for c, why, is_planned in step_saves(geo, req, start, end, req.planned[gid]):
            if not pool.num_free:
                stats.count("saves_skipped")
                continue
            rolling = why is SavePurpose.ROLLING
            out.append(PlannedSave(gid, c, pool.pop(gid), rolling, is_planned))
    return out
