"""Counters, gauges and per-request statistics (spec §12.1, §12.2).

The `prefix_cache_*` counters move only when `allocate` admits a request, so for any window of
operations Σ cached_tokens == Δ prefix_cache_hits exactly; a server can reconcile its usage
blocks against its Prometheus counters without tolerance.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvreuse.core.kinds import EntryKind
from kvreuse.core.pool import BlockPool

if TYPE_CHECKING:
    from kvreuse.core.config import Geometry
    from kvreuse.core.request import RequestState
    from kvreuse.core.tiers.stack import TierStack

COUNTER_NAMES = (
    "prefix_cache_requests",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "prefix_cache_preempted_requests",
    "prefix_cache_preempted_queries",
    "prefix_cache_preempted_hits",
    "saves_published",
    "saves_held",
    "saves_discarded",
    "saves_skipped",
)


@dataclass(frozen=True, slots=True)
class RequestStats:
    """What one request got from the cache: its first admission's hit, and its latest.
    `tier_tokens`: per tier below the pool, the tokens of the first hit loaded from it (counted
    on the first full-attention group's pages, as `TierStack.hit_tokens`); empty without tiers
    or without loads."""

    request_id: str
    cached_tokens: int
    reason: str
    admissions: int
    last_hit: int
    last_reason: str
    tier_tokens: tuple[int, ...] = ()


class CacheStats:
    """The manager's counts (spec §12.1) and the statistics of finished requests.

    `counters` (COUNTER_NAMES), admissions' `reasons` and copy-on-write copies per kind
    (`cow`) change only through the methods below, whoever counts: the facade, and the
    allocation and commit rules (saves). The last `capacity` finished requests' statistics
    are kept (None: all), so `request_stats` answers for them after `finish`."""

    __slots__ = ("_capacity", "_finished", "counters", "cow", "reasons")

    def __init__(self, capacity: int | None) -> None:
        self.counters: Counter[str] = Counter({name: 0 for name in COUNTER_NAMES})
        self.reasons: Counter[str] = Counter()
        self.cow: Counter[str] = Counter()
        self._finished: OrderedDict[str, RequestStats] = OrderedDict()
        self._capacity = capacity

    def count(self, name: str, n: int = 1) -> None:
        """Add `n` to counter `name` (the saves' counters)."""
        self.counters[name] += n

    def count_copy(self, kind: str) -> None:
        """A plan copies a partial page of a group of `kind` (copy-on-write)."""
        self.cow[kind] += 1

    def count_admission(
        self, st: RequestState, hit: int, reason: str, tier_tokens: tuple[int, ...] = ()
    ) -> None:
        """12.1: a first admission moves the prefix_cache_* counters, a re-admission the
        preempted_* ones; per-request statistics keep the first admission's hit and reason
        (and what of it each tier gave, `RequestStats.tier_tokens`)."""
        counters = self.counters
        if st.note_admission(hit, reason, tier_tokens):
            counters["prefix_cache_requests"] += 1
            counters["prefix_cache_queries"] += st.prompt_len
            counters["prefix_cache_hits"] += hit
            self.reasons[reason] += 1
        else:
            counters["prefix_cache_preempted_requests"] += 1
            counters["prefix_cache_preempted_queries"] += len(st.tokens)
            counters["prefix_cache_preempted_hits"] += hit

    def uncount_admission(self, st: RequestState, stack: TierStack | None) -> None:
        """Take back the counts of the request's last admission, whose tier loads failed: it
        delivered nothing, and its next admission counts in its place (a first one as the
        first)."""
        counters = self.counters
        if st.admissions == 1:
            counters["prefix_cache_requests"] -= 1
            counters["prefix_cache_queries"] -= st.prompt_len
            counters["prefix_cache_hits"] -= st.first_hit
            self.reasons[st.first_reason] -= 1
            if stack is not None and st.first_tier_tokens:
                stack.uncount_hit_tokens(st.first_tier_tokens)
        elif st.admissions > 1:
            counters["prefix_cache_preempted_requests"] -= 1
            counters["prefix_cache_preempted_queries"] -= len(st.tokens)
            counters["prefix_cache_preempted_hits"] -= st.last_hit
        st.unnote_admission()

    # ------------------------------------------------------------------ finished requests
    def keep_finished(self, st: RequestState) -> None:
        """`st` finished: keep its statistics, dropping the oldest beyond the capacity."""
        self._finished[st.request_id] = stats_of(st)
        cap = self._capacity
        while cap is not None and len(self._finished) > cap:
            self._finished.popitem(last=False)

    def finished(self, request_id: str) -> RequestStats | None:
        """The kept statistics of a finished request, or None."""
        return self._finished.get(request_id)

    def forget_finished(self, request_id: str) -> None:
        """A request of this id is registered again: its old statistics go."""
        self._finished.pop(request_id, None)

    # ------------------------------------------------------------------ the metrics
    def metrics(
        self, geo: Geometry, pool: BlockPool, events_dropped: int, stack: TierStack
    ) -> dict[str, Any]:
        """Spec §12.1's counters and gauges; with tiers below the pool, `tiers` holds each
        tier's (`tier_snapshot`)."""
        out: dict[str, Any] = snapshot(
            geo, pool, self.counters, self.reasons, self.cow, events_dropped
        )
        if stack:
            out["tiers"] = tier_snapshot(geo, stack)
        return out


def stats_of(st: RequestState) -> RequestStats:
    """What `request_stats` reports of a registered request."""
    return RequestStats(
        st.request_id,
        st.first_hit,
        st.first_reason,
        st.admissions,
        st.last_hit,
        st.last_reason,
        st.first_tier_tokens,
    )


def snapshot(
    geo: Geometry,
    pool: BlockPool,
    counters: Counter[str],
    reasons: Counter[str],
    cow: Counter[str],
    events_dropped: int,
) -> dict[str, object]:
    """All metrics of spec 12.1 at this moment (counters are monotonic, gauges are live)."""
    in_use: Counter[str] = Counter()
    cached: Counter[str] = Counter()
    free = 0
    kinds = {g.group_id: g.kind for g in geo.groups}
    for b in range(1, pool.num_blocks):
        if pool.ref[b] > 0:
            in_use[kinds[pool.group[b]]] += 1
        elif pool.has_keys(b):
            cached[kinds[pool.group[b]]] += 1
        else:
            free += 1
    entries: Counter[str] = Counter({k.value: 0 for k in EntryKind})
    for b in range(1, pool.num_blocks):
        if pool.has_keys(b):
            for boundary, _ in pool.key_list(b):
                entries[pool.kind_of(pool.group[b], boundary)] += 1
    num_in_use = sum(in_use.values())
    out: dict[str, object] = {name: counters[name] for name in COUNTER_NAMES[:6]}
    out["prefix_cache_reason_total"] = dict(reasons)
    out["kv_entries_published_total"] = dict(pool.num_published)
    out["kv_entries_removed_total"] = {"evicted": pool.num_removed_keys}
    out["kv_blocks_evicted_total"] = pool.num_evicted_blocks
    out["kv_cow_copies_total"] = dict(cow)
    out["kv_checkpoint_saves_total"] = {
        "published": counters["saves_published"],
        "held": counters["saves_held"],
        "discarded": counters["saves_discarded"],
        "skipped": counters["saves_skipped"],
    }
    out["kv_events_dropped_total"] = events_dropped
    out["kv_usage"] = num_in_use / (pool.num_blocks - 1)
    out["kv_blocks_in_use"] = {g.kind: in_use[g.kind] for g in geo.groups}
    out["kv_blocks_cached"] = {g.kind: cached[g.kind] for g in geo.groups}
    out["kv_blocks_free"] = free
    out["kv_index_entries"] = dict(entries)
    out["kv_ghost_keys"] = len(pool.ghost)
    return out


def tier_snapshot(geo: Geometry, stack: TierStack) -> dict[str, dict[str, object]]:
    """Per tier below the pool, by name: its medium, whether replicas share it, its capacity
    and the slots it holds (a shared tier's, whoever filled them), and this manager's counts:
    `hit_tokens` of first admissions (as `prefix_cache_hits` counts them, on the first
    full-attention group's pages), `loaded_blocks` per group kind, `stored_blocks` (copies
    into the tier: demotes, write-throughs and moves from the tier above) and
    `evicted_blocks` (slots it freed to make room, moved down or dropped) and `faulty_blocks`
    (slots dropped because the engine found their bytes missing or not theirs)."""
    out: dict[str, dict[str, object]] = {}
    for t, tier in enumerate(stack.tiers):
        loaded: Counter[str] = Counter({g.kind: 0 for g in geo.groups})
        for g in geo.groups:
            loaded[g.kind] += stack.num_loaded[t][g.group_id]
        out[tier.spec.name] = {
            "medium": tier.spec.medium,
            "shared": tier.shared,
            "capacity_blocks": tier.spec.num_blocks,
            "held_blocks": len(tier),
            "hit_tokens": stack.hit_tokens[t],
            "loaded_blocks": dict(loaded),
            "stored_blocks": stack.num_stored[t],
            "evicted_blocks": stack.num_evicted[t],
            "faulty_blocks": stack.num_faulty[t],
        }
    return out
