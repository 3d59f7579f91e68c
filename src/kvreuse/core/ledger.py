"""The step ledger: every plan handed out and not yet settled, and the steps they belong to.

    allocate ─► add ─► open step ─► seal ─► sealed steps (oldest first) ─► settle
                                                                     committed | discarded
    finish / preempt of a request in a sealed step ─► defer ─► released when that step settles

The ledger is the only owner of the open step, the sealed steps, the fates of settled steps,
the step ids and the plans parked by a deferral; it moves each request's step fields
(`open_plan`, `inflight`, `deferred`) through the request's own methods. Every change but `add`
moves `version`; the union of keys that live plans would publish (for `pending_hit`) is kept
between lookups and rebuilt only when `version` moved, so its validity rests on this module.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from kvreuse.core.config import Geometry
from kvreuse.core.plan import Copy, RequestPlan
from kvreuse.core.pool import NULL
from kvreuse.core.request import Deferral, RequestState


class StepFate(StrEnum):
    EMPTY = "empty"  # sealed with no plan: nothing to settle
    COMMITTED = "committed"
    DISCARDED = "discarded"


class PlannedSave(NamedTuple):
    """A save block popped for a step: settled by its commit, released if it never comes."""

    gid: int
    position: int
    block_id: int
    rolling: bool  # kept privately if valid (a candidate for φ(T) at finish)
    planned: bool  # published if valid (a replay, junction or dense position)


@dataclass(eq=False, slots=True)
class PlanRecord:
    """The manager's side of one RequestPlan: what its commit must settle.

    The step's [start, end) is kept here: the manager never trusts a plan it handed out. Built
    positionally: one is built per request per step.
    """

    req: RequestState
    plan: RequestPlan
    saves: list[PlannedSave]
    copies: list[Copy]
    start: int
    end: int
    step_id: int = -1
    withdrawn: bool = False
    keys: list[tuple[int, list[bytes]]] | None = None  # (gid, pending keys) while `keys_at` holds
    keys_at: tuple[int, int] = (-1, -1)  # (req.committed, req.chain.num_units) when computed
    # Known at allocation to publish nothing: no save, no unit boundary in (start, end], and no
    # other step of its request in flight to move T or the chain before it commits (most
    # decode plans). The pending-key union skips it without computing its keys.
    quiet: bool = False


MAX_SETTLED = 4096  # fates remembered, so a late commit of a settled step names its fate


class StepLedger:
    """Open and sealed steps, settled fates, and the pending-key union."""

    __slots__ = (
        "_geo",
        "_keys",
        "_keys_at",
        "_loud",
        "_next_step",
        "_num_loud",
        "_open",
        "_parked",
        "_sealed",
        "_seen",
        "_settled",
        "num_plans",
        "version",
    )

    def __init__(self, geo: Geometry) -> None:
        self._geo = geo
        self._open: list[PlanRecord] = []
        self._sealed: OrderedDict[int, list[PlanRecord]] = OrderedDict()
        self._settled: OrderedDict[int, StepFate] = OrderedDict()
        self._parked: dict[str, list[PlanRecord]] = {}  # request id -> open plans a deferral took
        self._next_step = 1
        self.num_plans = 0  # plans ever handed out
        self.version = 0  # moves on every change but `add`
        self._keys: list[set[bytes]] = []
        self._keys_at = -1  # `version` the union was built at
        self._seen = 0  # loud plans the union includes
        # Per open or sealed step (the open one under key 0), its records that are not quiet:
        # only they can add pending keys, so the union reads them and never the quiet ones.
        self._loud: dict[int, list[PlanRecord]] = {0: []}
        self._num_loud = 0  # loud plans ever added

    # ------------------------------------------------------------------ reading
    def records(self) -> list[PlanRecord]:
        """Every open and sealed record, withdrawn ones included."""
        return [*self._open, *itertools.chain.from_iterable(self._sealed.values())]

    def parked(self) -> list[PlanRecord]:
        """Open plans withdrawn by a deferral, not yet released (they still hold references)."""
        return [r for recs in self._parked.values() for r in recs]

    def parked_of(self, req: RequestState) -> list[PlanRecord]:
        return self._parked.get(req.request_id, [])

    def records_of(self, req: RequestState) -> list[PlanRecord]:
        """The request's records in sealed, unsettled steps, oldest first."""
        return [r for sid in req.inflight for r in self._sealed[sid] if r.req is req]

    def check(self, step_id: int, op: str) -> bool:
        """True for the oldest sealed step; False for an empty one; else raise naming why."""
        if step_id in self._sealed:
            first = next(iter(self._sealed))
            if step_id != first:
                raise ValueError(f"{op}: step {step_id} is out of order; settle step {first} first")
            return True
        fate = self._settled.get(step_id)
        if fate is StepFate.EMPTY:
            return False
        if fate is not None:
            raise ValueError(f"{op}: step {step_id} was already {fate}")
        raise ValueError(f"{op}: unknown step {step_id!r}")

    def sealed(self, step_id: int) -> list[PlanRecord]:
        return self._sealed[step_id]

    # ------------------------------------------------------------------ changes
    def add(self, rec: PlanRecord) -> None:
        """A plan joins the open step (the union only grows: `version` stays)."""
        rec.req.open_step(rec.plan, rec.end)
        self._open.append(rec)
        self.num_plans += 1
        if not rec.quiet:
            self._loud[0].append(rec)
            self._num_loud += 1

    def seal(self) -> tuple[int, list[PlanRecord]]:
        """Close the open step; returns its id and records, in allocation order."""
        recs, self._open = self._open, []
        step_id = self._next_step
        self._next_step += 1
        if recs:
            for r in recs:
                r.step_id = step_id
            RequestState.enter_step([r.req for r in recs], step_id)
            self._sealed[step_id] = recs
            self._loud[step_id] = self._loud[0]
            self._loud[0] = []
        else:
            self._remember(step_id, StepFate.EMPTY)
        self.version += 1
        return step_id, recs

    def settle(self, step_id: int, fate: StepFate) -> list[PlanRecord]:
        """Remove the oldest sealed step (checked by `check`) and record its fate."""
        recs = self._sealed.pop(step_id)
        del self._loud[step_id]
        self._remember(step_id, fate)
        RequestState.leave_step([r.req for r in recs], step_id)
        self.version += 1
        return recs

    def _remember(self, step_id: int, fate: StepFate) -> None:
        self._settled[step_id] = fate
        while len(self._settled) > MAX_SETTLED:  # bounded: a long-running server seals many
            self._settled.popitem(last=False)

    def withdraw_open(self, req: RequestState) -> list[PlanRecord]:
        """Take the request's plan out of the open step (the engine will never see it)."""
        if req.open_plan is None:  # `add` set it and only a seal or a withdrawal clears it
            return []
        recs = [r for r in self._open if r.req is req]
        if recs:
            self._open = [r for r in self._open if r.req is not req]
            self._loud[0] = [r for r in self._loud[0] if r.req is not req]
            self.version += 1
        req.withdraw_open()
        return recs

    def withdraw_sealed(self, req: RequestState) -> list[PlanRecord]:
        """Mark the request's records in unsettled steps withdrawn: their commits publish
        nothing, and their references are released with the request."""
        recs = self.records_of(req)
        for r in recs:
            r.withdrawn = True
        self.version += 1
        return recs

    def defer(self, req: RequestState, what: Deferral) -> None:
        """A finish or preempt waits for the request's oldest sealed step. An open plan is
        withdrawn now and parked, released in the same batch when the release happens."""
        req.defer(what)
        for rec in self.withdraw_open(req):
            rec.withdrawn = True
            self._parked.setdefault(req.request_id, []).append(rec)
        self.version += 1

    def forget(self, req: RequestState) -> None:
        """The request was released: it is in no step any more (`RequestState.release`
        clears its step fields)."""
        self._parked.pop(req.request_id, None)
        self.version += 1

    # ------------------------------------------------------------------ pending keys
    def pending_keys(self) -> list[set[bytes]] | None:
        """Per group, the keys live plans would publish if they committed in full (for
        `pending_hit`); None when no plan is open or sealed."""
        if not self._open and not self._sealed:
            return None
        if self._keys_at == self.version:  # only plans were added since: extend the union
            new, loud = self._num_loud - self._seen, self._loud[0]
            recs = loud[len(loud) - new :] if new else []
        else:
            self._keys = [set() for _ in self._geo.groups]
            recs = list(itertools.chain.from_iterable(self._loud.values()))
        keys = self._keys
        for rec in recs:
            req = rec.req
            if rec.withdrawn or req.deferred is not None:
                continue
            # A record's keys change only when its request commits (T, processed, the chain
            # and window frees move together), so they are cached per (T, units).
            rec_at = (req.committed, req.chain.num_units)
            if rec.keys is None or rec.keys_at != rec_at:
                rec.keys, rec.keys_at = plan_keys(self._geo, rec), rec_at
            for gid, group_keys in rec.keys:
                keys[gid].update(group_keys)
        self._keys_at, self._seen = self.version, self._num_loud
        return keys


def plan_keys(geo: Geometry, rec: PlanRecord) -> list[tuple[int, list[bytes]]]:
    """(gid, keys) a plan's commit would publish if it committed with T′ = end."""
    req = rec.req
    u = geo.hash_unit
    hashes = req.chain.hashes
    E = min(rec.end, req.chain.num_units * u)
    if not rec.saves and all(d + u > E for d in req.processed.values()):
        return []  # most decode plans: no boundary of theirs is left to publish
    out: list[tuple[int, list[bytes]]] = []
    for gid, row in req.tables.items():
        g = geo.groups[gid]
        if not g.cacheable:
            continue
        page = g.page_size
        lo, hi = req.processed[gid] // u + 1, E // u  # the units whose boundaries it keys
        if lo > hi:
            continue
        if page == u and NULL not in row[lo - 1 : hi]:  # one page per unit, all held: a slice
            out.append((gid, hashes[lo : hi + 1]))
        else:
            out.append((gid, [hashes[k] for k in range(lo, hi + 1) if row[(k * u - 1) // page]]))
    saves = [(s.gid, hashes[s.position // u]) for s in rec.saves if s.planned and s.position <= E]
    out.extend((gid, [key]) for gid, key in saves)
    return out
