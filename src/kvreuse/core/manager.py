"""`KVCacheManager`: the facade with the operations of spec §3.

    add_request ─► lookup ─► allocate(lookup) ─► seal_step ─► engine ─► commit
                                                                    └─► discard
    finish / preempt (deferred while the request sits in a sealed, uncommitted step)

Rules of use are checked here, before anything changes: a call that breaks one raises and leaves
the manager as it was. The work itself lives in `lookup`, `allocate` and `commit`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from kvreuse.core.allocate import (
    admission_required,
    admit,
    grow,
    growth_required,
    hit_blocks,
)
from kvreuse.core.commit import (
    Checked,
    apply_commit,
    release_request,
    settle_in_order,
    settle_outcomes,
)
from kvreuse.core.config import CacheConfig
from kvreuse.core.errors import StaleLookupError, UnknownRequestError
from kvreuse.core.events import Event, EventLog
from kvreuse.core.invariants import audit
from kvreuse.core.ledger import PlanRecord, StepFate, StepLedger
from kvreuse.core.lookup import LookupResult, compute_lookup
from kvreuse.core.metrics import CacheStats, RequestStats, stats_of
from kvreuse.core.plan import RequestPlan, StepPlan
from kvreuse.core.pool import BlockPool
from kvreuse.core.request import Deferral, Phase, Request, RequestState, new_request_state
from kvreuse.core.rules import check_allocate, plain_growth
from kvreuse.core.savepoints import (
    next_save_position,
    planned_positions,
    replay_point,
    save_positions,
)
from kvreuse.core.tiers.loads import NO_TIER_TOKENS, TierLoads, forget_faults
from kvreuse.core.tiers.ops import Keys, TierOp
from kvreuse.core.tiers.shared import SharedTier
from kvreuse.core.tiers.spec import TierSpec
from kvreuse.core.tiers.stack import TierStack
from kvreuse.core.tiers.view import TierView, device_hits, tier_sources
from kvreuse.core.views import describe, export_entries, export_ghost


class KVCacheManager:
    """Prefix-cache manager over one block pool shared by every group (spec §3).

    It owns the registered requests and the epoch, and composes the owners of everything
    else, each changed only through its methods: blocks and keys (`pool`, a `BlockPool`),
    steps and in-flight plans (`ledger`, a `StepLedger`), counts and finished requests'
    statistics (`stats`, a `CacheStats`), pending events (`events`, an `EventLog`), the tiers
    below the pool and whose turn a shared one is (`tiers`, a `TierStack`) and the loads not
    yet committed (`loads`, `TierLoads`). The rules of lookup, allocation and commit are
    functions of their modules, each given only the owners it uses.
    """

    def __init__(
        self,
        config: CacheConfig,
        tiers: Sequence[TierSpec | SharedTier] = (),
        *,
        check_prefix_hashes: bool = False,
    ) -> None:
        """`tiers`: memory below the pool, in order (kvreuse.core.tiers; a SharedTier is one
        several managers share, kvreuse.core.tiers.shared); none by default.
        `check_prefix_hashes`: `Request.prefix_hashes` are checked against the prompt's own
        digests (one more pass over each prompt that has them) instead of trusted."""
        if not isinstance(config, CacheConfig):
            raise TypeError(f"KVCacheManager needs a CacheConfig, got {type(config).__name__}")
        for spec in tiers:
            if isinstance(spec, SharedTier):
                spec.check_layout(config)
            elif not isinstance(spec, TierSpec):
                raise TypeError(
                    f"tiers must be TierSpec or SharedTier objects, got {type(spec).__name__}"
                )
        self.config = config
        self.geo = config.geometry
        self.events = EventLog(config.enable_events, config.max_pending_events)
        self.pool = BlockPool(config, self.events)
        self.hasher = config.hasher()
        self._check_prefix_hashes = bool(check_prefix_hashes)
        self.ledger = StepLedger(self.geo)
        self.requests: dict[str, RequestState] = {}
        self.stats = CacheStats(config.finished_stats_capacity)
        self.epoch = 0
        self.tiers = TierStack(tiers, [g.kind for g in self.geo.groups], self.events)
        self._view = TierView(self.pool, self.tiers) if tiers else self.pool
        if tiers:
            self.pool.on_evict = self.tiers.demote
        if self.tiers.writes_through:
            self.pool.on_publish = self.tiers.write_through
        self.loads = TierLoads(self.pool, self.tiers)

    # ------------------------------------------------------------------ requests
    def add_request(self, req: Request) -> None:
        """Register a request (WAITING) and hash its prompt."""
        if not isinstance(req, Request):
            raise TypeError(f"add_request needs a Request, got {type(req).__name__}")
        if req.request_id in self.requests:
            raise ValueError(f"request {req.request_id!r} is already registered")
        st = new_request_state(req, self.hasher, self._check_prefix_hashes)
        self.requests[st.request_id] = st
        self.stats.forget_finished(st.request_id)

    def _get(self, rid: str, op: str) -> RequestState:
        st = self.requests.get(rid)
        if st is None:
            gone = " (it has finished)" if self.stats.finished(rid) is not None else ""
            raise UnknownRequestError(f"{op}: unknown request {rid!r}{gone}")
        return st

    # ------------------------------------------------------------------ lookup and allocation
    def lookup(self, req_id: str) -> LookupResult:
        """Pure: what an admission now would reuse (spec §7)."""
        st = self._get(req_id, "lookup")
        self.tiers.check_turn()
        if st.phase is not Phase.WAITING:
            raise ValueError(
                f"lookup: request {req_id!r} is running; only waiting requests look up"
            )
        # Keys uncommitted plans would publish (7.8), built only when such plans exist.
        pending = self.ledger.pending_keys() if self.geo.caching_enabled else None
        res = compute_lookup(
            self.geo,
            self._view,
            st.request_id,
            st.chain,
            len(st.tokens),
            skip_read=st.skip_read,
            pending=pending,
            epoch=self.epoch + self.tiers.shared_version(),
        )
        if self.tiers:
            loads = tier_sources(res)
            if loads:
                return replace(res, loads=tuple(loads))
        return res

    def _check_alloc(
        self, req_id: str, num_new_tokens: int, lookup: LookupResult | None, num_extra_slots: int
    ) -> RequestState:
        st = self._get(req_id, "allocate")
        self.tiers.check_turn()
        if lookup is None and num_extra_slots == 0 and plain_growth(st, num_new_tokens):
            return st
        check_allocate(
            st,
            num_new_tokens,
            lookup,
            num_extra_slots,
            self.epoch + self.tiers.shared_version(),
            in_flight_ends=[r.end for r in self.ledger.records_of(st) if not r.withdrawn],
        )
        return st

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
            end = lookup.hit + num_new_tokens
            return admission_required(
                self.geo, self.pool, lookup, end, num_extra_slots, hit_blocks(lookup)
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
        geo, pool = self.geo, self.pool
        free = pool.num_free
        rec: PlanRecord | None
        if st.phase is Phase.WAITING:
            assert lookup is not None
            hits = hit_blocks(lookup)  # counted and then adopted: computed once
            end = lookup.hit + num_new_tokens
            if lookup.loads:  # a fresh block per tier block, popped before the admission's
                hits = device_hits(hits)
            need = admission_required(geo, pool, lookup, end, num_extra_slots, hits)
            if need + len(lookup.loads) > free - self.config.admission_watermark_blocks:
                return None
            res, from_tiers = lookup, NO_TIER_TOKENS
            if lookup.loads:
                pool.adopt_many(hits)  # before the loads' pops, which must not evict them
                (res, from_tiers), hits = self.loads.begin(lookup, st.admissions == 0), []
            rec = admit(geo, pool, self.stats, st, res, num_new_tokens, num_extra_slots, hits)
            if lookup.loads:
                self.loads.note(rec)
            self.stats.count_admission(st, lookup.hit, lookup.reason, from_tiers)
        else:
            rec = grow(geo, pool, self.stats, st, num_new_tokens, num_extra_slots)
            if rec is None:
                return None
        for c in rec.copies:
            self.stats.count_copy(geo.groups[c.group_id].kind)
        self.ledger.add(rec)
        self.epoch += 1
        return rec.plan

    def allocate_many(
        self,
        request_ids: Sequence[str],
        num_new_tokens: int | Sequence[int] = 1,
        *,
        stop_when_full: bool = False,
    ) -> list[RequestPlan | None]:
        """Grow running requests in one call: the same as `[allocate(rid, n) for ...]`.

        Each item is atomic: None means that request did not fit and nothing of it changed;
        later items are still tried, unless `stop_when_full`: then the list ends before the
        first request that did not fit (a scheduler that preempts on a full pool continues
        from there). `num_new_tokens` is one count for all (a decode step: one token plus the
        drafts to verify) or one per request. Only running requests grow this way (an
        admission needs its lookup); a call that breaks a rule raises, as `allocate` does,
        with the items before it done.
        """
        self.tiers.check_turn()
        ids = list(request_ids)
        if isinstance(num_new_tokens, int):
            counts: Sequence[int] = [num_new_tokens] * len(ids)
        else:
            counts = list(num_new_tokens)
            if len(counts) != len(ids):
                raise ValueError(
                    f"allocate_many: {len(ids)} request ids but {len(counts)} token counts"
                )
        check, geo, pool, stats, add = (
            self._check_alloc,
            self.geo,
            self.pool,
            self.stats,
            self.ledger.add,
        )
        out: list[RequestPlan | None] = []
        requests = self.requests
        for rid, n in zip(ids, counts, strict=True):
            st = requests.get(rid)
            if st is None or not plain_growth(st, n):
                st = check(rid, n, None, 0)  # allocate's own checks: the same errors
            rec = grow(geo, pool, stats, st, n, 0)
            if rec is None:
                if stop_when_full:
                    break
                out.append(None)
                continue
            add(rec)
            self.epoch += 1
            out.append(rec.plan)
        return out

    # ------------------------------------------------------------------ steps
    def seal_step(self) -> StepPlan:
        """Close the open step: its plans, in allocation order."""
        step_id, recs = self.ledger.seal()
        plans = [r.plan for r in recs]
        ops = self.tiers.take_ops() if self.tiers else []
        return StepPlan(step_id, plans, [c for p in plans for c in p.copies], ops)

    def commit(self, step_id: int, outcomes: Mapping[str, Any]) -> None:
        """The step's forward finished: publish what it computed (spec §10).

        `outcomes` maps each live request of the step to its `Outcome` (or the spec's tuple).
        A tier that writes through copies what is published: those ops go with the next
        sealed step, or to `take_tier_ops()`.
        """
        if not self.ledger.check(step_id, "commit"):
            return
        self.tiers.check_publish_turn()
        self._commit(step_id, settle_outcomes(self.ledger.sealed(step_id), outcomes))

    def commit_batch(self, step_id: int, outcomes: Sequence[Any]) -> None:
        """`commit` with the outcomes in the step's plan order, one per `StepPlan.requests`
        entry (None or anything for a request finished or preempted since the seal: it is
        ignored, as in `commit`). An engine that runs the plans in order returns this as is."""
        if not self.ledger.check(step_id, "commit"):
            return
        self.tiers.check_publish_turn()
        self._commit(step_id, settle_in_order(self.ledger.sealed(step_id), outcomes))

    def _commit(self, step_id: int, parsed: list[tuple[PlanRecord, Checked]]) -> None:
        recs = self.ledger.settle(step_id, StepFate.COMMITTED)
        apply, geo, pool, stats = apply_commit, self.geo, self.pool, self.stats
        if self.loads:
            self.loads.publish(recs)
        for rec, outcome in parsed:
            apply(geo, pool, stats, rec, outcome)
        if len(parsed) < len(recs):  # else no record was withdrawn or deferred
            self._settle_deferred(recs, discard=False)
        self.epoch += 1

    def discard(self, step_id: int) -> None:
        """The step's forward failed: publish nothing; release (preempt) its requests."""
        if not self.ledger.check(step_id, "discard"):
            return
        recs = self.ledger.settle(step_id, StepFate.DISCARDED)
        if self.loads:
            self.loads.drop(recs)  # never keyed: released as fresh blocks
        self._settle_deferred(recs, discard=True)
        self.epoch += 1

    def _settle_deferred(self, recs: list[PlanRecord], discard: bool) -> None:
        """Carry out the releases that waited for this step (every request of a discarded
        one): the request's later records are withdrawn and released with it."""
        for rec in recs:
            st = rec.req
            if rec.withdrawn or (not discard and st.deferred is None):
                continue
            then = st.deferred or Deferral.PREEMPT
            later = self.ledger.withdraw_sealed(st)
            self._release(st, [rec, *later, *self.ledger.parked_of(st)], then)

    # ------------------------------------------------------------------ release
    def _release(self, st: RequestState, dropped: list[PlanRecord], then: Deferral) -> None:
        release_request(self.geo, self.pool, self.stats, st, dropped)
        if self.loads:
            self.loads.drop(dropped)  # its loaded blocks went back unkeyed
        self.ledger.forget(st)
        st.release(Phase.FINISHED if then is Deferral.FINISH else Phase.WAITING)
        if then is Deferral.FINISH:
            self._forget(st)

    def _forget(self, st: RequestState) -> None:
        del self.requests[st.request_id]
        self.stats.keep_finished(st)

    def finish(self, req_id: str) -> RequestStats:
        """Normal end or abort (spec §11.5); returns the request's final statistics."""
        st = self._get(req_id, "finish")
        self.tiers.check_publish_turn()  # a hybrid's finish state is published
        if st.inflight:
            if st.deferred is not Deferral.FINISH:  # a repeated finish changes nothing
                self.ledger.defer(st, Deferral.FINISH)
                self.epoch += 1
            return stats_of(st)
        if st.phase is Phase.RUNNING:
            self._release(st, self.ledger.withdraw_open(st), Deferral.FINISH)
        else:
            self._forget(st)
        self.epoch += 1
        stats = self.stats.finished(req_id)  # what `_forget` kept, unless capacity is 0
        return stats if stats is not None else stats_of(st)

    def preempt(self, req_id: str) -> None:
        """Release a running request's blocks; it waits for a new lookup (spec §11.5)."""
        st = self._get(req_id, "preempt")
        if st.phase is not Phase.RUNNING:
            raise ValueError(f"preempt: request {req_id!r} is not running")
        self.tiers.check_publish_turn()
        if st.inflight:
            if st.deferred is None:
                self.ledger.defer(st, Deferral.PREEMPT)
                self.epoch += 1
            return
        self._release(st, self.ledger.withdraw_open(st), Deferral.PREEMPT)
        self.epoch += 1

    def reset(self) -> bool:
        """Drop every key, the tiers' too, if no block is in use (spec §11.6)."""
        if self.pool.num_free != self.pool.num_blocks - 1:
            return False
        self.pool.clear_keys()  # the pool records AllBlocksCleared
        self.tiers.clear()  # a reset forgets the tiers too: their bytes may be stale (weights)
        self.epoch += 1
        return True

    def evict(self, block_id: int) -> None:
        """Test support: evict one block with count 0 now, keeping its queue place (11.3)."""
        self.tiers.check_turn()
        self.pool.evict(block_id)
        self.epoch += 1

    def save_positions(self, req_id: str, lookup: LookupResult | None = None) -> list[int]:
        """Positions where the request still wants a recurrent state (spec §9.4): a scheduler
        ends prefill chunks there. A waiting request needs the lookup it will be admitted with."""
        st = self._get(req_id, "save_positions")
        epoch = self.epoch + self.tiers.shared_version()
        if lookup is not None and (lookup.epoch != epoch or lookup.request_id != req_id):
            raise StaleLookupError(f"save_positions: stale lookup for {req_id!r}; look up again")
        if st.phase is Phase.WAITING:
            if lookup is None:
                raise ValueError(f"save_positions: {req_id!r} is waiting; pass its LookupResult")
            index, h, junction = self.pool.index, lookup.hit, lookup.junction
            planned = {
                g.group_id: planned_positions(self.geo, st, g, h, junction, index[g.group_id])
                for g in self.geo.recurrent
            }
            return save_positions(self.geo, st, planned, lookup.hit)
        return save_positions(self.geo, st, st.planned, st.scheduled)

    def next_save_position(self, req_id: str, lookup: LookupResult | None = None) -> int | None:
        """The first of `save_positions(req_id, lookup)`, or None (what a scheduler reads)."""
        st = self._get(req_id, "save_positions")
        if lookup is None and st.phase is not Phase.WAITING:
            return next_save_position(self.geo, st, st.planned, st.scheduled)
        positions = self.save_positions(req_id, lookup)
        return positions[0] if positions else None

    def check_invariants(self) -> None:
        """A from-scratch audit of spec §14 (slow); raises InvariantError naming the broken one."""
        audit(self.geo, self.pool, self.requests.values(), self.ledger)
        self.tiers.audit()

    # ------------------------------------------------------------------ tiers
    def tier_faults(
        self, slots: Iterable[tuple[int, int, int, Keys]], block_ids: Iterable[int] = ()
    ) -> list[str]:
        """What the engine could not carry out of the ops it was handed, as misses: each of
        `slots` (tier, slot, group id, the keys of the op that read or wrote it) was found
        without those keys' bytes (absent, altered, another block's, or the store unreachable),
        so it is forgotten while it still holds those keys; `block_ids` are device blocks a
        `Load` did not fill. The requests that loaded those blocks, all in sealed steps, publish
        nothing at their step's commit and go back to wait for a new lookup, as a preemption
        does; their admission is not counted (a hit never delivered). Returns those requests'
        ids."""
        failed = forget_faults(self.tiers, self.loads, self.ledger, self.stats, slots, block_ids)
        self.epoch += 1
        return failed

    def take_tier_ops(self) -> list[TierOp]:
        """The tier ops decided since the last `seal_step()` (the write-through copies of what
        a commit or a finish published), for an engine that runs them now instead of before
        the next step; a shared tier they held is free for the other managers again."""
        return self.tiers.take_ops() if self.tiers else []

    # ------------------------------------------------------------------ what it shows
    def request_stats(self, req_id: str) -> RequestStats:
        st = self.requests.get(req_id)
        if st is not None:
            return stats_of(st)
        stats = self.stats.finished(req_id)
        if stats is not None:
            return stats
        raise UnknownRequestError(f"request_stats: unknown or forgotten request {req_id!r}")

    def metrics(self) -> dict[str, Any]:
        """Spec §12.1's counters and gauges; with tiers below the pool, `tiers` holds each
        tier's (`kvreuse.core.metrics.tier_snapshot`)."""
        return self.stats.metrics(self.geo, self.pool, self.events.dropped, self.tiers)

    def take_events(self) -> list[Event]:
        return self.events.take(self.geo)

    def set_event_log(self, enabled: bool) -> None:
        """Record events (spec §13) or not, whatever `enable_events` said: a server records only
        while something publishes them. Turning it off drops what is pending."""
        self.events.set_enabled(enabled)

    def describe(self, req_id: str | None = None) -> str:
        if req_id is None:
            return describe(self.geo, self.pool, self.metrics(), None, [])
        st = self._get(req_id, "describe")
        wanted = self.save_positions(req_id) if st.phase is Phase.RUNNING else []
        return describe(self.geo, self.pool, self.metrics(), st, wanted)

    def export_entries(self) -> list[tuple[int, int, bytes, str, int]]:
        return export_entries(self.pool)

    def export_ghost(self) -> list[tuple[int, int, bytes]]:
        return export_ghost(self.pool)

    def replay_point(self, prompt_len: int) -> int:
        """ρ(P) of this geometry (spec §8): the hit of an identical resend."""
        return replay_point(self.geo, prompt_len)
