"""`KVCacheManager`: the facade with the operations of spec §3.

    add_request ─► lookup ─► allocate(lookup) ─► seal_step ─► engine ─► commit
                                                                    └─► discard
    finish / preempt (deferred while the request sits in a sealed, uncommitted step)

Rules of use are checked here, before anything changes: a call that breaks one raises and leaves
the manager as it was. The work itself lives in `lookup`, `allocate` and `commit`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from typing import Any

from kvreuse.core import commit as _commit
from kvreuse.core.allocate import (
    PlanRecord,
    admission_required,
    admit,
    grow,
    growth_required,
    hit_blocks,
    planned_positions,
    replay_point,
)
from kvreuse.core.config import CacheConfig
from kvreuse.core.errors import StaleLookupError, UnknownRequestError
from kvreuse.core.events import Event, EventLog
from kvreuse.core.hashing import Hasher
from kvreuse.core.lookup import LookupResult, compute_lookup
from kvreuse.core.metrics import RequestStats, count_admission, new_counters, snapshot
from kvreuse.core.pending import PendingKeys
from kvreuse.core.plan import RequestPlan, StepPlan
from kvreuse.core.pool import BlockPool
from kvreuse.core.request import Phase, Request, RequestState, new_request_state
from kvreuse.core.rules import check_allocate
from kvreuse.core.views import describe, export_entries, export_ghost, save_positions


class KVCacheManager:
    """Prefix-cache manager over one block pool shared by every group (spec §3)."""

    def __init__(self, config: CacheConfig) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"KVCacheManager needs a CacheConfig, got {type(config).__name__}")
        self.config = config
        self.geo = config.geometry
        self.events = EventLog(config.enable_events, config.max_pending_events)
        self.pool = BlockPool(config, self.events)
        self.hasher = Hasher(
            config.hash_algo, self.geo.hash_unit, self.geo.lookahead, config.hash_seed
        )
        self.requests: dict[str, RequestState] = {}
        self.counters = new_counters()
        self.reasons: Counter[str] = Counter()
        self.cow: Counter[str] = Counter()
        self.epoch = 0
        self._open: list[PlanRecord] = []
        self._sealed: OrderedDict[int, list[PlanRecord]] = OrderedDict()
        self._next_step = 1
        self._finished: OrderedDict[str, RequestStats] = OrderedDict()
        self._settled: OrderedDict[int, str] = OrderedDict()
        self._num_plans = 0  # plans ever handed out by allocate
        self._pending = PendingKeys()

    # ------------------------------------------------------------------ requests
    def add_request(self, req: Request) -> None:
        """Register a request (WAITING) and hash its prompt."""
        if not isinstance(req, Request):
            raise TypeError(f"add_request needs a Request, got {type(req).__name__}")
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id!r} is already registered")
        st = new_request_state(req, self.hasher)
        self.requests[st.request_id] = st
        rid = st.request_id
        self._finished.pop(rid, None)

    def _get(self, rid: str, op: str) -> RequestState:
        st = self.requests.get(rid)
        if st is None:
            gone = " (it has finished)" if rid in self._finished else ""
            raise UnknownRequestError(f"{op}: unknown request {rid!r}{gone}")
        return st

    # ------------------------------------------------------------------ lookup and allocation
    def lookup(self, req_id: str) -> LookupResult:
        """Pure: what an admission now would reuse (spec §7)."""
        st = self._get(req_id, "lookup")
        if st.phase is not Phase.WAITING:
            raise ValueError(
                f"lookup: request {req_id!r} is running; only waiting requests look up"
            )
        return compute_lookup(self.geo, self.pool, st, self._pending_keys(), self.epoch)

    def _pending_keys(self) -> list[set[bytes]] | None:
        """Keys uncommitted plans would publish (7.8), built only when such plans exist."""
        if not self.geo.caching_enabled or not (self._open or self._sealed):
            return None
        return self._pending.union(self)

    def _check_alloc(
        self, req_id: str, num_new_tokens: int, lookup: LookupResult | None, num_extra_slots: int
    ) -> RequestState:
        st = self._get(req_id, "allocate")
        if (  # the common growth (decode, next prefill chunk): provably valid, checked inline
            lookup is None
            and type(num_new_tokens) is int
            and num_extra_slots == 0
            and st.phase is Phase.RUNNING
            and st.open_plan is None
            and st.deferred is None
            and not st.inflight
            and num_new_tokens > 0
            and (
                st.scheduled == len(st.tokens) - 1  # decode (plus drafts)
                or st.scheduled + num_new_tokens <= len(st.tokens)  # prefill within N
            )
        ):
            return st
        check_allocate(
            st,
            num_new_tokens,
            lookup,
            num_extra_slots,
            self.epoch,
            in_flight_ends=[r.end for r in self._records(st) if not r.withdrawn],
        )
        return st

    def _records(self, st: RequestState) -> list[PlanRecord]:
        return [r for sid in st.inflight for r in self._sealed[sid] if r.req is st]

    def blocks_needed(
        self,
        req_id: str,
        num_new_tokens: int,
        lookup: LookupResult | None = None,
        num_extra_slots: int = 0,
    ) -> int:
        """Pure: the `required` count (9.5) of the matching `allocate`."""
        st = self._check_alloc(req_id, num_new_tokens, lookup, num_extra_slots)
        if st.phase is Phase.WAITING:
            assert lookup is not None
            return admission_required(
                self.geo, self, lookup, lookup.hit + num_new_tokens, num_extra_slots
            )
        return growth_required(self.geo, st, st.scheduled + num_new_tokens, num_extra_slots)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def allocate(
        self,
        req_id: str,
        num_new_tokens: int,
        lookup: LookupResult | None = None,
        num_extra_slots: int = 0,
    ) -> RequestPlan | None:
        """Admit a waiting request or grow a running one; None (nothing changed) if it won't fit."""
        st = self._check_alloc(req_id, num_new_tokens, lookup, num_extra_slots)
        free = self.pool.num_free
        if st.phase is Phase.WAITING:
            assert lookup is not None
            hits = hit_blocks(lookup)  # counted and then adopted: computed once
            need = admission_required(
                self.geo, self, lookup, lookup.hit + num_new_tokens, num_extra_slots, hits
            )
            if need > free - self.config.admission_watermark_blocks:
                return None
            rec = admit(self, st, lookup, num_new_tokens, num_extra_slots, hits)
            count_admission(self.counters, self.reasons, st, lookup.hit, lookup.reason)
            st.phase = Phase.RUNNING
        else:
            grown = grow(self, st, num_new_tokens, num_extra_slots, free)
            if grown is None:
                return None
            rec = grown
        for c in rec.copies:
            self.cow[self.geo.groups[c.group_id].kind] += 1
        st.open_plan = rec.plan
        self._open.append(rec)
        self._num_plans += 1  # with the epoch: PendingKeys sees that only a plan was added
        self.epoch += 1
        return rec.plan

    # ------------------------------------------------------------------ steps
    def seal_step(self) -> StepPlan:
        """Close the open step: its plans, in allocation order."""
        recs, self._open = self._open, []
        step_id = self._next_step
        self._next_step += 1
        plans = [r.plan for r in recs]
        step = StepPlan(step_id, plans, [c for p in plans for c in p.copies])
        if recs:
            for r in recs:
                r.step_id = step_id
                r.req.open_plan = None
                r.req.inflight.append(step_id)
            self._sealed[step_id] = recs
        else:
            self._mark(step_id, "empty")
        return step

    def _check_step(self, step_id: int, op: str) -> bool:
        """True for the oldest sealed step; False for an empty or settled one; else raise."""
        if step_id in self._sealed:
            first = next(iter(self._sealed))
            if step_id != first:
                raise ValueError(f"{op}: step {step_id} is out of order; settle step {first} first")
            return True
        state = self._settled.get(step_id)
        if state == "empty":
            return False
        if state is not None:
            raise ValueError(f"{op}: step {step_id} was already {state}")
        raise ValueError(f"{op}: unknown step {step_id!r}")

    def _mark(self, step_id: int, state: str) -> None:
        self._settled[step_id] = state
        while len(self._settled) > 4096:  # bounded: a long-running server seals many steps
            self._settled.popitem(last=False)

    def commit(self, step_id: int, outcomes: Mapping[str, Any]) -> None:
        """The step's forward finished: publish what it computed (spec §10)."""
        if not self._check_step(step_id, "commit"):
            return
        parsed = _commit.settle_outcomes(self._sealed[step_id], outcomes)
        recs = self._sealed.pop(step_id)
        self._mark(step_id, "committed")
        for rec, (t_new, tokens, saved) in parsed:
            rec.req.inflight.remove(step_id)
            _commit.apply_commit(self, rec, t_new, tokens, saved)
            if not rec.req.inflight:
                rec.req.scheduled = rec.req.committed
        self._settle_deferred(recs, step_id, discard=False)
        self.epoch += 1

    def discard(self, step_id: int) -> None:
        """The step's forward failed: publish nothing; release (preempt) its requests."""
        if not self._check_step(step_id, "discard"):
            return
        recs = self._sealed.pop(step_id)
        self._mark(step_id, "discarded")
        self._settle_deferred(recs, step_id, discard=True)
        self.epoch += 1

    def _settle_deferred(self, recs: list[PlanRecord], step_id: int, discard: bool) -> None:
        for rec in recs:
            st = rec.req
            if rec.withdrawn or (not discard and st.deferred is None):
                continue
            if step_id in st.inflight:
                st.inflight.remove(step_id)
            then = st.deferred or "preempt"
            dropped = [rec, *self._withdraw_later(st), *st.parked]
            self._release(st, dropped, then)

    def _withdraw_later(self, st: RequestState) -> list[PlanRecord]:
        later = self._records(st)
        for r in later:
            r.withdrawn = True
        return later

    # ------------------------------------------------------------------ release
    def _release(self, st: RequestState, dropped: list[PlanRecord], then: str) -> None:
        _commit.release_request(self, st, dropped, then)
        if then == "finish":
            self._forget(st)

    def _forget(self, st: RequestState) -> None:
        del self.requests[st.request_id]
        self._finished[st.request_id] = self._stats(st)
        cap = self.config.finished_stats_capacity
        while cap is not None and len(self._finished) > cap:
            self._finished.popitem(last=False)

    def _withdraw_open(self, st: RequestState) -> list[PlanRecord]:
        recs = [r for r in self._open if r.req is st]
        self._open = [r for r in self._open if r.req is not st]
        st.open_plan = None
        return recs

    def _defer(self, st: RequestState, what: str) -> None:
        """10.6: the release waits for the first sealed step; nothing of it will publish, so
        its plans stop counting towards pending_hit now (docs/decisions.md D4)."""
        st.deferred = what
        # A plan still in the open step is withdrawn now (10.6), so the engine never runs it;
        # its references are released with the deferred release, in the same batch.
        for rec in self._withdraw_open(st):
            rec.withdrawn = True
            st.parked.append(rec)
        self.epoch += 1

    def finish(self, req_id: str) -> RequestStats:
        """Normal end or abort (spec §11.5); returns the request's final statistics."""
        st = self._get(req_id, "finish")
        if st.inflight:
            if st.deferred != "finish":  # a repeated finish changes nothing
                self._defer(st, "finish")
            return self._stats(st)
        if st.phase is Phase.RUNNING:
            self._release(st, self._withdraw_open(st), "finish")
        else:
            self._forget(st)
        self.epoch += 1
        return self._stats(st)  # also when finished_stats_capacity keeps none

    def preempt(self, req_id: str) -> None:
        """Release a running request's blocks; it waits for a new lookup (spec §11.5)."""
        st = self._get(req_id, "preempt")
        if st.phase is not Phase.RUNNING:
            raise ValueError(f"preempt: request {req_id!r} is not running")
        if st.inflight:
            if st.deferred is None:
                self._defer(st, "preempt")
            return
        self._release(st, self._withdraw_open(st), "preempt")
        self.epoch += 1

    def reset(self) -> bool:
        """Drop every key if no block is in use (spec §11.6)."""
        if self.pool.num_free != self.pool.num_blocks - 1:
            return False
        self.pool.clear_keys()
        if self.events.enabled:
            self.events.cleared()
        self.epoch += 1
        return True

    def evict(self, block_id: int) -> None:
        """Test support: evict one block with count 0 now, keeping its queue place (11.3)."""
        self.pool.evict(block_id)
        self.epoch += 1

    # ------------------------------------------------------------------ observation
    def _stats(self, st: RequestState) -> RequestStats:
        return RequestStats(
            st.request_id, st.first_hit, st.first_reason, st.admissions, st.last_hit, st.last_reason
        )

    def request_stats(self, req_id: str) -> RequestStats:
        st = self.requests.get(req_id)
        if st is not None:
            return self._stats(st)
        if req_id in self._finished:
            return self._finished[req_id]
        raise UnknownRequestError(f"request_stats: unknown or forgotten request {req_id!r}")

    def metrics(self) -> dict[str, Any]:
        return snapshot(
            self.geo, self.pool, self.counters, self.reasons, self.cow, self.events.dropped
        )

    def take_events(self) -> list[Event]:
        return self.events.take(self.geo)

    def save_positions(self, req_id: str, lookup: LookupResult | None = None) -> list[int]:
        st = self._get(req_id, "save_positions")
        if lookup is not None and (lookup.epoch != self.epoch or lookup.request_id != req_id):
            raise StaleLookupError(f"save_positions: stale lookup for {req_id!r}; look up again")
        if st.phase is Phase.WAITING:
            if lookup is None:
                raise ValueError(f"save_positions: {req_id!r} is waiting; pass its LookupResult")
            planned = {
                g.group_id: planned_positions(self.geo, self, st, g, lookup.hit, lookup.junction)
                for g in self.geo.groups
                if not g.is_attention
            }
            return save_positions(self, st, planned, lookup.hit)
        return save_positions(self, st, st.planned, st.scheduled)

    def next_save_position(self, req_id: str, lookup: LookupResult | None = None) -> int | None:
        positions = self.save_positions(req_id, lookup)
        return positions[0] if positions else None

    def describe(self, req_id: str | None = None) -> str:
        return describe(self, None if req_id is None else self._get(req_id, "describe"))

    def export_entries(self) -> list[tuple[int, int, bytes, str, int]]:
        return export_entries(self.pool)

    def export_ghost(self) -> list[tuple[int, int, bytes]]:
        return export_ghost(self.pool)

    def check_invariants(self) -> None:
        from kvreuse.core.invariants import check_invariants

        check_invariants(self)

    def replay_point(self, prompt_len: int) -> int:
        """ρ(P) of this geometry (spec §8): the hit of an identical resend."""
        return replay_point(self.geo, prompt_len)
