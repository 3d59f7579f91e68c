"""Replay a workload on a geometry through the scheduler and account for every token.

The simulated clock advances by a cost model per step (an estimate: prefill tokens at a fixed
rate plus a fixed decode-step time), so arrivals interleave with the batch as they would on a
server, and TTFT estimates show what reuse saves. A request joins the scheduler when it has
arrived and every request it depends on (`after`, `history`) has finished.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from kvreuse.core import KVCacheManager, Request
from kvreuse.deployment import Deployment
from kvreuse.sched import FakeEngine, Scheduler, Seq
from kvreuse.sim.workload import WorkloadError, WorkloadRequest, tokens_of


@dataclass(frozen=True, slots=True)
class CostModel:
    """An estimate, not a measurement: step time = prefill tokens / rate + a decode step."""

    prefill_tokens_per_s: float = 20_000.0
    decode_step_s: float = 0.02

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s <= 0 or self.decode_step_s < 0:
            raise ValueError(
                "cost model: prefill_tokens_per_s must be > 0 and decode_step_s ≥ 0, got "
                f"{self.prefill_tokens_per_s}, {self.decode_step_s}"
            )

    def step_time(self, num_prefill: int, num_decode: int) -> float:
        return num_prefill / self.prefill_tokens_per_s + (self.decode_step_s if num_decode else 0.0)


@dataclass
class SimResult:
    requests: list[dict[str, Any]]
    summary: dict[str, Any]
    timeline: list[tuple[float, float, float]] = field(default_factory=list)  # t, usage, hit rate


class SimulationError(RuntimeError):
    """The run could not finish, or a reconciliation check failed."""


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cycle collector (reference counting still frees everything).

    A run holds every waiting request's tokens; each full collection walks all of them, which
    made a 10,000-request run spend half its time in the collector. The scheduler, the core
    and the simulator build no reference cycles (tests/sim/test_simulate.py checks this), so
    nothing accumulates while the collector is paused.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def simulate(
    geo: Deployment,
    workload: list[WorkloadRequest],
    cost: CostModel | None = None,
    on_step: Callable[[int, int], None] | None = None,
    draft_accept_rate: float = 0.7,
) -> SimResult:
    """Replay `workload` on `geo`. With `num_spec_tokens` > 0 in the geometry, each draft is
    accepted with probability `draft_accept_rate` (seeded: runs are reproducible)."""
    engine = FakeEngine(accept_rate=draft_accept_rate)
    with _cyclic_gc_paused():
        return _simulate(geo, workload, cost or CostModel(), on_step, engine)


def _simulate(
    geo: Deployment,
    workload: list[WorkloadRequest],
    cost: CostModel,
    on_step: Callable[[int, int], None] | None,
    engine: FakeEngine,
) -> SimResult:
    # Nobody drains events in a simulation; recording them would keep every finished
    # request's tokens alive until the event queue's bound.
    mgr = KVCacheManager(replace(geo.cache, enable_events=False))
    sched = Scheduler(mgr, engine, geo.sched)
    pending = list(workload)
    # Tokens are kept only for requests a later prompt quotes with {"history": id}: holding
    # every finished request's tokens would make the run's memory (and the garbage
    # collector's passes over it) grow with the workload.
    quoted = {h for w in workload for h in w.histories()}
    history: dict[str, list[int]] = {}
    done: set[str] = set()
    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    rows: dict[str, dict[str, Any]] = {}
    clock, peak_usage, timeline = 0.0, 0.0, []
    num_prefill = num_deferred = 0
    while pending or sched.has_work():
        pending = _release_ready(sched, pending, history, done, arrived, clock, geo.max_model_len)
        if not sched.has_work():
            ready = [w.arrival for w in pending if w.dependencies() <= done]
            if not ready:
                raise SimulationError(f"{len(pending)} requests wait on requests that never finish")
            clock = max(clock, min(ready))
            continue
        st = sched.step()
        clock += cost.step_time(st.num_prefill_tokens, st.num_decode_tokens)
        num_prefill += st.num_prefill_tokens
        num_deferred += len(st.deferred)
        for seq in sched.running:
            if seq.output and seq.request_id not in first_token:
                first_token[seq.request_id] = clock
        for rid in (*st.finished, *st.rejected):
            seq = sched.pop_finished(rid)
            first_token.setdefault(rid, clock)
            done.add(rid)
            if rid in quoted:
                history[rid] = list(seq.request.prompt_token_ids) + seq.output
            rows[rid] = _row(seq, arrived, first_token)
        # O(1) per step: usage from the free-queue length (spec §11.1), not a metrics() scan
        usage = 1 - mgr.num_free_blocks / (mgr.config.num_blocks - 1)
        peak_usage = max(peak_usage, usage)
        queries = mgr.counters["prefix_cache_queries"]
        hits = mgr.counters["prefix_cache_hits"]
        timeline.append((clock, usage, hits / queries if queries else 0.0))
        if on_step is not None:
            on_step(len(done), len(workload))
    ordered = [rows[w.request_id] for w in workload]
    summary = _summary(mgr, ordered, peak_usage, clock)
    summary["steps"] = sched.num_steps
    summary["prefill_tokens_computed"] = num_prefill
    summary["deferral_waits"] = num_deferred  # request-steps spent waiting for a shared prefix
    return SimResult(ordered, summary, timeline)


def _release_ready(
    sched: Scheduler,
    pending: list[WorkloadRequest],
    history: dict[str, list[int]],
    done: set[str],
    arrived: dict[str, float],
    clock: float,
    max_model_len: int | None,
) -> list[WorkloadRequest]:
    keep = []
    for w in pending:
        if w.arrival > clock or not w.dependencies() <= done:
            keep.append(w)
            continue
        tokens = tokens_of(w.prompt, history)
        if not tokens:
            raise WorkloadError(f"request {w.request_id!r}: its prompt resolves to no tokens")
        if max_model_len is not None and len(tokens) + w.max_tokens > max_model_len:
            raise WorkloadError(
                f"request {w.request_id!r}: {len(tokens)} prompt tokens + "
                f"{w.max_tokens} max_tokens exceed max_model_len {max_model_len}"
            )
        sched.add(Request(w.request_id, tokens, lora=w.lora, cache_salt=w.cache_salt), w.max_tokens)
        arrived[w.request_id] = max(clock, w.arrival)
    return keep


def _row(seq: Seq, arrived: dict[str, float], first_token: dict[str, float]) -> dict[str, Any]:
    stats, rid = seq.stats, seq.request_id
    return {
        "id": rid,
        "prompt_tokens": seq.prompt_len,
        "cached_tokens": stats.cached_tokens if stats else 0,
        "reason": stats.reason if stats else "not_admitted",
        "output_tokens": len(seq.output),
        "preemptions": seq.preemptions,
        "finish_reason": seq.finish_reason,
        "ttft_estimate_s": round(first_token[rid] - arrived[rid], 6),
    }


def _summary(
    mgr: KVCacheManager,
    rows: list[dict[str, Any]],
    peak_usage: float,
    clock: float,
) -> dict[str, Any]:
    m = mgr.metrics()
    cached = sum(r["cached_tokens"] for r in rows)
    checks = {
        "cached_tokens_equal_hits": cached == m["prefix_cache_hits"],
        "prompts_equal_queries": sum(
            r["prompt_tokens"] for r in rows if r["finish_reason"] != "too_large"
        )
        == m["prefix_cache_queries"],
        "every_request_finished": all(r["reason"] != "not_admitted" for r in rows)
        and len(rows) == m["prefix_cache_requests"],
        # a request whose prompt cannot fit even an empty pool is rejected by the scheduler
        "every_request_fits": not any(r["finish_reason"] == "too_large" for r in rows),
    }
    try:
        mgr.check_invariants()
        checks["invariants"] = True
    except AssertionError:
        checks["invariants"] = False
    return {
        "requests": len(rows),
        "queries": m["prefix_cache_queries"],
        "hits": m["prefix_cache_hits"],
        "hit_rate": m["prefix_cache_hits"] / max(1, m["prefix_cache_queries"]),
        "preemptions": sum(r["preemptions"] for r in rows),
        "evicted_blocks": m["kv_blocks_evicted_total"],
        "retained_blocks": m["kv_blocks_cached"],
        "peak_usage": peak_usage,
        "capacity_tokens": mgr.config.capacity_tokens(),
        "index_entries": m["kv_index_entries"],
        "simulated_seconds": round(clock, 6),
        "reconciliation": checks,
        "reconciled": all(checks.values()),
    }


def without_deferral(
    geo: Deployment,
    workload: list[WorkloadRequest],
    cost: CostModel | None = None,
    draft_accept_rate: float = 0.7,
) -> dict[str, Any]:
    """The same run with in-batch deferral off: what waiting for a shared prefix saved."""
    off = replace(geo, sched=replace(geo.sched, defer_shared_prefix=False))
    s = simulate(off, workload, cost, draft_accept_rate=draft_accept_rate).summary
    keys = ("prefill_tokens_computed", "hits", "hit_rate", "simulated_seconds", "steps")
    return {k: s[k] for k in keys}
