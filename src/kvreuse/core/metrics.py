"""Counters, gauges and per-request statistics (spec §12.1, §12.2).

The `prefix_cache_*` counters move only when `allocate` admits a request, so for any window of
operations Σ cached_tokens == Δ prefix_cache_hits exactly; a server can reconcile its usage
blocks against its Prometheus counters without tolerance.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvreuse.core.kinds import EntryKind
from kvreuse.core.pool import BlockPool

if TYPE_CHECKING:
    from kvreuse.core.config import Geometry
    from kvreuse.core.request import RequestState
    from kvreuse.core.tiers import TierStack

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


def count_admission(
    counters: Counter[str],
    reasons: Counter[str],
    st: RequestState,
    hit: int,
    reason: str,
    tier_tokens: tuple[int, ...] = (),
) -> None:
    """12.1: a first admission moves the prefix_cache_* counters, a re-admission the
    preempted_* ones; per-request statistics keep the first admission's hit and reason (and
    what of it each tier gave, `RequestStats.tier_tokens`)."""
    if st.note_admission(hit, reason, tier_tokens):
        counters["prefix_cache_requests"] += 1
        counters["prefix_cache_queries"] += st.prompt_len
        counters["prefix_cache_hits"] += hit
        reasons[reason] += 1
    else:
        counters["prefix_cache_preempted_requests"] += 1
        counters["prefix_cache_preempted_queries"] += len(st.tokens)
        counters["prefix_cache_preempted_hits"] += hit


def uncount_admission(
    counters: Counter[str], reasons: Counter[str], st: RequestState, stack: TierStack | None
) -> None:
    """Take back the counts of the request's last admission, whose tier loads failed: it
    delivered nothing, and its next admission counts in its place (a first one as the first)."""
    if st.admissions == 1:
        counters["prefix_cache_requests"] -= 1
        counters["prefix_cache_queries"] -= st.prompt_len
        counters["prefix_cache_hits"] -= st.first_hit
        reasons[st.first_reason] -= 1
        if stack is not None and st.first_tier_tokens:
            got = st.first_tier_tokens
            stack.hit_tokens = [a - b for a, b in zip(stack.hit_tokens, got, strict=True)]
    elif st.admissions > 1:
        counters["prefix_cache_preempted_requests"] -= 1
        counters["prefix_cache_preempted_queries"] -= len(st.tokens)
        counters["prefix_cache_preempted_hits"] -= st.last_hit
    st.unnote_admission()


def new_counters() -> Counter[str]:
    return Counter({name: 0 for name in COUNTER_NAMES})


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
