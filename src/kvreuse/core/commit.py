"""Commit, publication and release (spec §10, §11.5).

Nothing becomes findable before the forward that computed it has finished. A commit, per request
in plan order: append tokens → settle copies → settle saves → publish attention entries →
keep the rolling states → free pages that left a window → T = T′. Every block whose reference
count reaches 0 in one of those steps joins the request's single release batch (11.2).

Attention publication of one commit, page B = 64, u = 16, processed boundary d, E = min(T′, n·u):

    d=128                 E=208
      |  144  160  176  192 | 208
      +----+----+----+----+----+
       partial ×3, full 192, partial 208      (duplicates skipped; a skip ends an event run)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

from kvreuse.core.config import Geometry
from kvreuse.core.ledger import PlannedSave, PlanRecord
from kvreuse.core.metrics import CacheStats
from kvreuse.core.pool import NULL, BlockPool
from kvreuse.core.request import MAX_TOKEN, Phase, RequestState, check_tokens
from kvreuse.core.savepoints import finish_point, rolling_range


class Outcome(NamedTuple):
    """What the engine reports for one request of a step (spec §10.1). A plain tuple
    `(T′, new_token_ids)` or `(T′, new_token_ids, saved_positions)` is accepted as well."""

    t_new: int  # T′: tokens whose KV (and states) are now valid
    new_token_ids: list[int]
    saved_positions: AbstractSet[int] | None = None  # None: every planned save was written


# ---------------------------------------------------------------------------- validation
_NO_SAVES: frozenset[int] = frozenset()


# A checked outcome: (T′, new tokens, saved positions or None). A plain tuple, not an `Outcome`:
# one is built per request per step, and a named tuple costs a frame more to build.
Checked = tuple[int, list[int], AbstractSet[int] | None]


def parse_outcome(rec: PlanRecord, outcome: Any) -> Checked:
    """Check one outcome (an `Outcome` or a plain tuple) against spec §10.1.

    One validation, its cheapest checks first: the common decode outcome (an int T′ and one
    valid token) passes each of them without the general token check."""
    req = rec.req
    rid = req.request_id
    size = len(outcome) if type(outcome) is tuple or isinstance(outcome, tuple | list) else 0
    if size not in (2, 3):
        raise ValueError(
            f"commit: outcome of {rid!r} must be (T', new_token_ids) or "
            f"(T', new_token_ids, saved_positions), got {outcome!r}"
        )
    t_new, new_tokens = outcome[0], outcome[1]
    if type(t_new) is not int and (isinstance(t_new, bool) or not isinstance(t_new, int)):
        raise ValueError(f"commit: T' of {rid!r} must be an int, got {t_new!r}")
    if (
        type(new_tokens) is list
        and len(new_tokens) == 1
        and type(new_tokens[0]) is int
        and 0 <= new_tokens[0] < MAX_TOKEN
    ):
        tokens = [new_tokens[0]]
    else:
        tokens = check_tokens(new_tokens, f"commit: new_token_ids of {rid!r}")
    if not rec.start <= t_new <= rec.end:
        raise ValueError(
            f"commit: T'={t_new} of {rid!r} is outside its step [{rec.start}, {rec.end}]"
        )
    num = len(req.tokens)
    if not tokens:
        if t_new >= num:
            raise ValueError(
                f"commit: {rid!r} reports T'={t_new} ≥ N={num} without a new token; a step "
                "that reaches the end of the known tokens samples one"
            )
    elif not num <= t_new <= num + len(tokens) - 1:
        raise ValueError(
            f"commit: {rid!r} reports T'={t_new} with {len(tokens)} new tokens; with N={num} "
            f"T' must lie in [{num}, {num + len(tokens) - 1}]"
        )
    saved = outcome[2] if size == 3 else None
    if saved is None:
        return t_new, tokens, None
    if not saved:
        return t_new, tokens, _NO_SAVES  # the engine wrote no state (the common decode)
    saved = set(saved)
    mine = {s.position for s in rec.saves}
    if not saved <= mine:
        raise ValueError(
            f"commit: saved_positions {sorted(saved - mine)} of {rid!r} are not saves of "
            f"this step (planned: {sorted(mine)})"
        )
    return t_new, tokens, saved


# ---------------------------------------------------------------------------- commit
def apply_commit(
    geo: Geometry, pool: BlockPool, stats: CacheStats, rec: PlanRecord, outcome: Checked
) -> None:
    """Steps 1–7 of spec §10.1 for one request.

    Each step is skipped, with the same result, when it has nothing to do. Most decode commits
    leave nothing to any of them and end once their tokens are appended."""
    req = rec.req
    t_new, tokens, _ = outcome
    u = geo.hash_unit
    num_units = req.chain.num_units
    committed = req.committed
    req.advance(t_new, tokens, geo.lookahead, u)  # T = T′ (and the units the tokens complete)
    nu = req.chain.num_units * u
    # Nothing left to any later step (most decode commits): no copy or save to settle, T′ in
    # T's unit, no group that frees pages, no unit completed where held states could change,
    # and no boundary in (d, E] to publish (10.3).
    if (
        not rec.saves
        and not rec.copies
        and not geo.windowed
        and t_new // u == committed // u
        and (nu == num_units * u or not geo.recurrent)
    ):
        e = min(t_new, nu)
        processed = req.processed
        for gid in geo.published:
            if e >= processed[gid] + u:
                break
        else:
            return
    release: list[int] = []
    for c in rec.copies:  # 2. pending copy references (dst keeps its table reference)
        release += (c.src, c.dst)
    by_group: dict[int, list[PlannedSave]] = {}
    for s in rec.saves:  # most decode commits settle no save
        by_group.setdefault(s.gid, []).append(s)
    # The held rolling states are kept in rolling_range(units, ⌊T′/u⌋): with no save to add
    # one, the same units and T′ in the unit of the last commit, they are still the right ones
    # (most decode commits of a hybrid).
    same_range = not by_group and nu == num_units * u and t_new // u == committed // u
    for g in geo.groups:
        gid = g.group_id
        if g.is_attention:
            if g.cacheable and geo.caching_enabled and min(t_new, nu) > req.processed[gid]:
                _publish_attention(geo, pool, req, gid, min(t_new, nu))
            if g.frees_pages:
                _window_free(geo, req, gid, t_new, release)
        elif not same_range:
            if gid in by_group:
                _settle_saves(geo, pool, stats, req, by_group[gid], outcome, release)
            if req.recurrent[gid].held:
                _keep_rolling(geo, req, gid, t_new, release)
    if release:
        pool.release(release)


def _publish_attention(geo: Geometry, pool: BlockPool, req: RequestState, gid: int, e: int) -> None:
    """10.3: key every boundary in (d, E] on the request's own page; skip NULL and duplicates."""
    u = geo.hash_unit
    d = req.processed[gid]
    if e <= d:
        return
    page = geo.groups[gid].page_size
    bounds = range(d + u, e + 1, u)
    k0 = (d + u) // u  # H[k0] keys the first boundary
    keys = req.chain.hashes[k0 : k0 + len(bounds)]
    row = req.tables[gid]
    if page == u:  # one boundary per page: the pages are a plain slice of the table
        blocks = row[k0 - 1 : k0 - 1 + len(bounds)]
    else:
        blocks = [row[(b - 1) // page] for b in bounds]
    pool.publish(gid, bounds, keys, blocks, req)
    req.mark_processed(gid, e // u * u)


def _settle_saves(
    geo: Geometry,
    pool: BlockPool,
    stats: CacheStats,
    req: RequestState,
    saves: list[PlannedSave],
    outcome: Checked,
    release: list[int],
) -> None:
    """10.1 step 3, one group: publish valid planned saves, hold valid rolling ones, release
    the rest (into `release`)."""
    if not saves:
        return
    gid = saves[0].gid
    t_new, _, saved = outcome
    u = geo.hash_unit
    nu = req.chain.num_units * u
    ordered = sorted(saves)
    # Every valid planned save is published in one call, in position order: of two saves at
    # one position, the first publishes and the second finds its key present.
    tries = [
        (c, blk)
        for _, c, blk, _, planned in ordered
        if planned and c <= nu and c <= t_new and (saved is None or c in saved)
    ]
    won: set[int] = set()
    if tries:
        hashes = req.chain.hashes
        positions = [c for c, _ in tries]
        keys = [hashes[c // u] for c in positions]
        won.update(pool.publish(gid, positions, keys, [blk for _, blk in tries], req))
    dropped: list[int] = []
    for _, c, blk, rolling, planned in ordered:
        valid = c <= t_new and (saved is None or c in saved)
        published = valid and planned and c in won
        if published:
            won.discard(c)  # a later save at the same position was not published
            req.note_published_state(gid, c)
            stats.count("saves_published")
        if valid and rolling:
            req.hold(gid, c, blk)  # the pending reference becomes the held reference
            if not published:
                stats.count("saves_held")
        else:
            dropped.append(blk)
            if not published:
                stats.count("saves_discarded")
    release.extend(dropped)


def _keep_rolling(
    geo: Geometry, req: RequestState, gid: int, t_new: int, release: list[int]
) -> None:
    """Keep held rolling states in [φ(T′), ⌊T′/u⌋·u]; release the others, newest first."""
    held = req.recurrent[gid].held
    lo, hi = rolling_range(geo, req.chain.num_units, t_new)
    if lo <= min(held) and max(held) <= hi:
        return  # most decode commits: the held states are still the ones to keep
    release += req.drop_held(gid, lo, hi)


def _window_free(
    geo: Geometry, req: RequestState, gid: int, t_new: int, release: list[int]
) -> None:
    """10.5: a group that frees pages (sliding, chunked) drops those no later token can attend
    to."""
    g = geo.groups[gid]
    limit = g.attend_from(t_new)  # later tokens attend from here on: pages below it are dead
    if limit // g.page_size > req.window_lo.get(gid, 0):  # else nothing left the window
        release += req.free_window(gid, limit // g.page_size)


# ---------------------------------------------------------------------------- release
def pending_refs(rec: PlanRecord) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """A record's pending references: copies by destination group, saves by group."""
    copies: dict[int, list[int]] = {}
    for c in rec.copies:
        copies.setdefault(c.group_id, []).extend((c.dst, c.src))
    saves: dict[int, list[int]] = {}
    if rec.saves:  # most plans (every attention-only one) reserve no save
        for s in sorted(rec.saves):
            saves.setdefault(s.gid, []).append(s.block_id)
    return copies, saves


def release_request(
    geo: Geometry,
    pool: BlockPool,
    stats: CacheStats,
    req: RequestState,
    dropped: Iterable[PlanRecord],
) -> None:
    """Spec §11.5 steps 2–3: publish φ(T), release every slot of the request and every pending
    reference of its dropped plans in one batch. The caller settles the ledger and the request
    (`RequestState.release`)."""
    copies: dict[int, list[int]] = {}
    saves: dict[int, list[int]] = {}
    for rec in dropped:  # most finishes drop no plan
        c, s = pending_refs(rec)
        for gid, blocks in c.items():
            copies.setdefault(gid, []).extend(blocks)
        for gid, blocks in s.items():
            saves.setdefault(gid, []).extend(blocks)
        stats.count("saves_discarded", len(rec.saves))
    if req.recurrent and req.phase is Phase.RUNNING and geo.caching_enabled:
        _publish_finish_state(geo, pool, stats, req)  # only held states publish
    order: list[int] = []
    tables, recurrent = req.tables, req.recurrent
    for g in geo.groups:
        gid = g.group_id
        if g.is_attention:
            row = tables.get(gid)
            if row is None:
                continue
            if copies:
                order.extend(copies.get(gid, ()))  # withdrawn copies: dst is also in the table
            # Descending table position; a NULL slot (a page left its window) holds nothing.
            order.extend([b for b in reversed(row) if b] if NULL in row else reversed(row))
        elif gid in recurrent:
            slots = recurrent[gid]
            order.extend(saves.get(gid, ()))
            held = slots.held
            if held:
                order.extend(held[c] for c in sorted(held, reverse=True))
            order.extend(reversed(slots.scratch))
            order.extend(copies.get(gid, ()))
            order.append(slots.live)
    pool.release(order)


def _publish_finish_state(
    geo: Geometry, pool: BlockPool, stats: CacheStats, req: RequestState
) -> None:
    """A finishing request publishes its held state at φ(T), the end of its last full unit
    (one unit earlier in drop mode), so a resend of the same conversation can resume there."""
    phi = finish_point(geo, req.chain.num_units, req.committed)
    if phi <= 0:
        return
    for gid, slots in req.recurrent.items():
        blk = slots.held.get(phi)
        if blk is None:
            continue
        if pool.publish(gid, [phi], [req.chain.hashes[phi // geo.hash_unit]], [blk], req):
            stats.count("saves_published")


def settle_outcomes(
    recs: Sequence[PlanRecord], outcomes: Mapping[str, Any]
) -> list[tuple[PlanRecord, Checked]]:
    """Validate every outcome of a step before changing anything (10.1)."""
    live = {r.req.request_id: r for r in recs if not r.withdrawn and r.req.deferred is None}
    if outcomes.keys() != live.keys():  # the usual step: exactly the live requests, in C
        known = {r.req.request_id for r in recs}
        for rid in outcomes:
            if rid not in known:
                raise ValueError(f"commit: outcome for {rid!r}, which is not in this step")
        missing = [rid for rid in live if rid not in outcomes]
        if missing:
            raise ValueError(f"commit: no outcome for {missing} (every live request needs one)")
    return [(r, parse_outcome(r, outcomes[rid])) for rid, r in live.items()]


def settle_in_order(
    recs: Sequence[PlanRecord], outcomes: Sequence[Any]
) -> list[tuple[PlanRecord, Checked]]:
    """`settle_outcomes` for outcomes given in the step's plan order."""
    if isinstance(outcomes, Mapping) or not isinstance(outcomes, Sequence):
        raise ValueError(
            "commit_batch: outcomes must be a sequence in plan order, "
            f"got {type(outcomes).__name__}"
        )
    if len(outcomes) != len(recs):
        raise ValueError(
            f"commit_batch: {len(outcomes)} outcomes for a step of {len(recs)} plans "
            "(one per StepPlan.requests entry, in order)"
        )
    return [
        (r, parse_outcome(r, o))
        for r, o in zip(recs, outcomes, strict=True)
        if not r.withdrawn and r.req.deferred is None
    ]
