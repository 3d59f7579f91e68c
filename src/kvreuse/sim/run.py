"""Replay a workload on a geometry through the scheduler and account for every token.

The simulated clock advances by a cost model per step (an estimate: prefill tokens at a fixed
rate plus a fixed decode-step time), so arrivals interleave with the batch as they would on a
server, and TTFT estimates show what reuse saves. A request joins the scheduler when it has
arrived, every request it depends on (`after`, `history`) has finished and the scheduler's
queue has room (`kvreuse.sim.feed`); its row leaves as soon as it finishes (`kvreuse.sim.tally`).

Stretches of decode steps in which nothing a decision reads can change are taken by the
scheduler's fast-forward (`kvreuse.sched.advance`), which calls the core only at the steps where
something happens; `fast_forward=False` steps every step through `Scheduler.step()`, the
reference both paths are tested equal to (rows, summary, timeline and KV events).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from kvreuse.core import KVCacheManager
from kvreuse.deployment import Deployment
from kvreuse.sched import DRAFT_ACCEPT_RATE, FakeEngine, FastForward, Scheduler, Seq, StepStats
from kvreuse.sim.blockchains import BlockChains
from kvreuse.sim.cost import CostMeter, CostModel
from kvreuse.sim.feed import Feeder
from kvreuse.sim.tally import Tally
from kvreuse.sim.workload import WorkloadRequest

Row = dict[str, Any]


@dataclass
class SimResult:
    """`requests`: the rows, in workload order (empty when they went to a sink instead);
    `tally`: what the summary table, the report and the plots need of them."""

    requests: list[dict[str, Any]]
    summary: dict[str, Any]
    timeline: list[tuple[float, float, float]] = field(default_factory=list)  # t, usage, hit rate
    tally: Tally = field(default_factory=Tally)
    num_fast_steps: int = 0  # steps the fast-forward took (the rest: Scheduler.step())
    evicted: list[int] = field(default_factory=list)  # per timeline step: blocks evicted so far


class SimulationError(RuntimeError):
    """The run could not finish, or a reconciliation check failed."""


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cycle collector (reference counting still frees everything).

    A run allocates millions of small objects (tokens, hashes, plans); each full collection
    walks every live one, which once made a 10,000-request run spend half its time in the
    collector. The scheduler, the core and the simulator build no reference cycles
    (tests/sim/test_simulate.py checks this), so nothing accumulates while it is paused.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class SimulationInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run; `result` holds what finished before (its summary says so)."""

    def __init__(self, result: SimResult) -> None:
        super().__init__()
        self.result = result


def simulate(
    dep: Deployment,
    workload: list[WorkloadRequest],
    cost: CostModel | None = None,
    on_step: Callable[[int, int], None] | None = None,
    draft_accept_rate: float = DRAFT_ACCEPT_RATE,
    sink: Callable[[Row], None] | None = None,
    fast_forward: bool = True,
    on_events: Callable[[int, list[Any]], None] | None = None,
) -> SimResult:
    """Replay `workload` on `dep`. With `num_spec_tokens` > 0 in the geometry, each draft is
    accepted with probability `draft_accept_rate` (seeded: runs are reproducible).

    Each request's row goes to `sink` as soon as it and every request before it in the
    workload have finished; without a sink the rows are kept in `SimResult.requests`.
    `fast_forward=False` takes every step through the scheduler's own step (the reference;
    the results are the same). `on_events(step, events)`, when given, turns the core's KV
    event log on and receives the events of each step as it ends (the step's number from 0)."""
    engine = FakeEngine(accept_rate=draft_accept_rate)
    kept: list[Row] = []
    with _cyclic_gc_paused():
        out = kept.append if sink is None else sink
        model = cost or CostModel.for_deployment(dep)
        run = _Run(dep, workload, model, engine, out, fast_forward, on_events)
        try:
            return run.loop(on_step, kept)
        except KeyboardInterrupt:
            raise SimulationInterrupted(run.result(kept, interrupted=True)) from None


class _Run:
    """One replay: the scheduler, the feeder, the clock, and the rows waiting for their turn."""

    def __init__(
        self,
        dep: Deployment,
        workload: list[WorkloadRequest],
        cost: CostModel,
        engine: FakeEngine,
        sink: Callable[[Row], None],
        fast_forward: bool = True,
        on_events: Callable[[int, list[Any]], None] | None = None,
    ) -> None:
        # Nobody drains events in a simulation unless asked to; recording them would keep
        # every finished request's tokens alive until the event queue's bound.
        cache = replace(dep.cache, enable_events=on_events is not None)
        self.mgr = KVCacheManager(cache, tiers=dep.tiers)
        self.on_events = on_events
        self.meter = CostMeter(engine, cost, self.mgr)
        self.sched = Scheduler(self.mgr, self.meter, dep.sched)
        script = self.meter.decode_script() if fast_forward else None
        self.fast = None if script is None else FastForward(self.sched, script)
        self.feeder = Feeder(workload, dep.max_model_len, BlockChains(self.mgr.hasher, workload))
        self.workload, self.cost, self.sink = workload, cost, sink
        self.tally = Tally()
        self.first_admitted: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.finished: dict[int, tuple[Row, bool]] = {}  # by workload index, until their turn
        self.next_row = 0  # workload index of the next row for the sink
        self.clock, self.peak_used, self.num_prefill, self.num_deferred = 0.0, 0, 0, 0
        self.num_fast_steps = 0
        self.timeline: list[tuple[float, float, float]] = []
        self.evicted: list[int] = []  # the pool's evictions so far, per step (for the plot)

    def loop(self, on_step: Callable[[int, int], None] | None, kept: list[Row]) -> SimResult:
        sched, feeder, limit = self.sched, self.feeder, self.sched.config.max_num_seqs
        while not feeder.done or sched.has_work():
            feeder.release(self.clock)
            feeder.feed(sched, limit)
            if not sched.has_work():
                nxt = feeder.next_arrival()
                if nxt is None:
                    left = len(self.workload) - feeder.num_handed
                    raise SimulationError(f"{left} requests wait on requests that never finish")
                self.clock = max(self.clock, nxt)
                continue
            if self.fast is not None and self.fast.begin():
                self._fast_forward(self.fast, on_step)
                if not sched.has_work():
                    continue
                # else handed back (all up to date) at a step that needs the scheduler's own
                # path, with this step's arrivals already released and fed
            start = self.clock
            self._account(sched.step(), start)
            if on_step is not None:
                on_step(self.tally.num_rows + len(self.finished), len(self.workload))
        return self.result(kept, interrupted=False)

    def _fast_forward(self, fast: FastForward, on_step: Callable[[int, int], None] | None) -> None:
        """Steps through the fast-forward while the loop above would only step: between two
        of them it releases and feeds arrivals as the loop does, and hands back (everything
        up to date) when nothing is left to run or the next step needs the scheduler's own
        path (it could admit, or preempt)."""
        sched, feeder, limit = self.sched, self.feeder, self.sched.config.max_num_seqs
        while True:
            start = self.clock
            st = fast.step()
            if st is None:
                return
            self._account(st, start)
            self.num_fast_steps += 1
            if on_step is not None:
                on_step(self.tally.num_rows + len(self.finished), len(self.workload))
            if not sched.has_work():
                fast.close()
                return
            feeder.release(self.clock)
            feeder.feed(sched, limit)
            if fast.quiet_steps() > 0:
                self._skip_quiet(fast)
                feeder.release(self.clock)
                feeder.feed(sched, limit)

    def _skip_quiet(self, fast: FastForward) -> None:
        """The quiet steps ahead at once, up to the one before which a request arrives: each
        costs one decode step (no state saved, no chunk), leaves usage and hit rate as they
        are, and adds its point to the timeline (the clock is added up step by step, as
        `_account` does, so it is the same to the last bit)."""
        num, nxt = fast.quiet_steps(), self.feeder.next_arrival()
        dt = self.meter.step_time(0, fast.num_decode_tokens)  # also counts no save, no chunk
        used = self.sched.num_usable_blocks - self.mgr.num_free_blocks
        counters = self.mgr.stats.counters
        queries, hits = counters["prefix_cache_queries"], counters["prefix_cache_hits"]
        point = (used / (self.mgr.config.num_blocks - 1), hits / queries if queries else 0.0)
        clock, taken, add = self.clock, 0, self.timeline.append
        evicted, add_evicted = self.mgr.pool.num_evicted_blocks, self.evicted.append
        while taken < num:
            clock += dt
            add((clock, *point))
            add_evicted(evicted)  # a quiet step allocates nothing, so evicts nothing
            taken += 1
            if nxt is not None and clock >= nxt:
                break  # released before the next step
        self.clock = clock
        self.peak_used = max(self.peak_used, used)
        if self.on_events is not None:
            for i in range(taken):
                self.on_events(self.sched.num_steps + i, [])
        fast.skip(taken)
        self.num_fast_steps += taken

    def _account(self, st: StepStats, start: float) -> None:
        """A step just taken, started at `start`: the clock, timings, finished rows, peak."""
        sched, mgr = self.sched, self.mgr
        if self.on_events is not None:
            self.on_events(sched.num_steps - 1, mgr.take_events())
        self.clock += self.meter.step_time(st.num_prefill_tokens, st.num_decode_tokens)
        self.num_prefill += st.num_prefill_tokens
        self.num_deferred += len(st.deferred)
        for rid in st.admitted:
            self.first_admitted.setdefault(rid, start)
        for rid in st.first_output:  # (a request that finished in this step reads the same)
            self.first_token.setdefault(rid, self.clock)
        for rid in (*st.finished, *st.rejected):
            seq = sched.pop_finished(rid)
            self.feeder.finished(seq, self.clock)
            self._finish(seq)
        # usage where it peaks: after the step's allocations, before its finishes released
        self.peak_used = max(self.peak_used, st.num_used_blocks)
        queries = mgr.stats.counters["prefix_cache_queries"]
        hits = mgr.stats.counters["prefix_cache_hits"]
        usage = st.num_used_blocks / (mgr.config.num_blocks - 1)
        self.timeline.append((self.clock, usage, hits / queries if queries else 0.0))
        self.evicted.append(mgr.pool.num_evicted_blocks)

    def _finish(self, seq: Seq) -> None:
        rid = seq.request_id
        arrived = self.feeder.arrived.pop(rid)
        admitted = self.first_admitted.pop(rid, None)
        # no first token recorded: it came in the step that finished the request
        first: float | None = self.first_token.pop(rid, self.clock)
        if seq.finish_reason == "too_large":
            admitted = first = None  # refused: whatever it computed was thrown away
        stats = seq.stats
        row = {
            "id": rid,
            "prompt_tokens": seq.prompt_len,
            "cached_tokens": stats.cached_tokens if stats else 0,
            "reason": stats.reason if stats else "not_admitted",
            "output_tokens": len(seq.output),
            "preemptions": seq.preemptions,
            "finish_reason": seq.finish_reason,
            # cost-model estimates: waiting for a seat, and arrival to first token (None for a
            # request refused as too large: it produced no token)
            "queue_s": None if admitted is None else round(admitted - arrived, 6),
            "ttft_estimate_s": None if first is None else round(first - arrived, 6),
        }
        self.finished[self.feeder.index[rid]] = (row, seq.cached_tokens is not None)
        while self.next_row in self.finished:  # rows leave in workload order
            row, was_admitted = self.finished.pop(self.next_row)
            self.sink(row)
            self.tally.add(row, was_admitted)
            self.next_row += 1

    def result(self, kept: list[Row], interrupted: bool) -> SimResult:
        if interrupted:  # the finished rows still waiting for an earlier one: keep them too
            for i in sorted(self.finished):
                row, was_admitted = self.finished.pop(i)
                self.sink(row)
                self.tally.add(row, was_admitted)
            summary = _partial_summary(self)
        else:
            summary = _summary(self)
        return SimResult(
            kept, summary, self.timeline, self.tally, self.num_fast_steps, self.evicted
        )


def _summary(run: _Run) -> dict[str, Any]:
    mgr, tally = run.mgr, run.tally
    m = mgr.metrics()
    checks = {
        "cached_tokens_equal_hits": tally.cached_tokens == m["prefix_cache_hits"],
        "prompts_equal_queries": tally.admitted_prompt_tokens == m["prefix_cache_queries"],
        "every_request_finished": tally.num_rows == len(run.workload)
        and tally.num_admitted == m["prefix_cache_requests"],
    }
    try:
        mgr.check_invariants()
        checks["invariants"] = True
    except AssertionError:
        checks["invariants"] = False
    capacity = mgr.config.capacity_tokens()
    return {
        "requests": tally.num_rows,
        "queries": m["prefix_cache_queries"],
        "hits": m["prefix_cache_hits"],
        "hit_rate": m["prefix_cache_hits"] / max(1, m["prefix_cache_queries"]),
        "preemptions": tally.preemptions,
        "evicted_blocks": m["kv_blocks_evicted_total"],
        "retained_blocks": m["kv_blocks_cached"],
        "peak_usage": run.peak_used / (mgr.config.num_blocks - 1),
        "capacity_tokens": capacity,
        "index_entries": m["kv_index_entries"],
        "simulated_seconds": round(run.clock, 6),
        "reconciliation": checks,
        "reconciled": all(checks.values()),
        # refused because they can never fit the cache: named, not a reconciliation failure
        "too_large": {"count": tally.num_too_large, "ids": tally.too_large},
        "steps": run.sched.num_steps,
        "prefill_tokens_computed": run.num_prefill,
        "deferral_waits": run.num_deferred,  # request-steps spent waiting for a shared prefix
        **run.meter.summary(),  # saved_states, prefill_chunks, prefill_seconds
    }


def _partial_summary(run: _Run) -> dict[str, Any]:
    """An interrupted run: what finished, without the end-of-run checks (requests in flight
    were counted by the core but have no row)."""
    tally = run.tally
    return {
        "interrupted": True,
        "requests": tally.num_rows,
        "requests_in_workload": len(run.workload),
        "hits": tally.cached_tokens,
        "preemptions": tally.preemptions,
        "too_large": {"count": tally.num_too_large, "ids": tally.too_large},
        "simulated_seconds": round(run.clock, 6),
        "steps": run.sched.num_steps,
        "reconciled": False,
    }


def without_deferral(
    dep: Deployment,
    workload: list[WorkloadRequest],
    cost: CostModel | None = None,
    draft_accept_rate: float = DRAFT_ACCEPT_RATE,
    on_step: Callable[[int, int], None] | None = None,
    fast_forward: bool = True,
) -> dict[str, Any]:
    """The same run with in-batch deferral off: what waiting for a shared prefix saved."""
    off = replace(dep, sched=replace(dep.sched, defer_shared_prefix=False))
    s = simulate(
        off, workload, cost, on_step, draft_accept_rate, sink=_discard, fast_forward=fast_forward
    ).summary
    keys = (
        "prefill_tokens_computed",
        "hits",
        "hit_rate",
        "simulated_seconds",
        "steps",
        "preemptions",
        "evicted_blocks",
    )
    return {k: s[k] for k in keys}


def _discard(row: Row) -> None:
    """The comparison run's rows: only its summary is used."""
