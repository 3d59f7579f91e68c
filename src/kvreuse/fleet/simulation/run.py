"""N simulated replicas behind the router, on one simulated clock.

Each replica is what `kvreuse simulate` runs for one: its own `KVCacheManager` and `Scheduler`
with the simulator's `FakeEngine`, stepped under the same cost model. The run is a queue of
events in time: a request becomes ready (arrival, dependencies finished) and the router picks its
replica from the mirrors and loads as they stand at that moment; a replica that has work and is
idle starts a step, which the core computes at once but whose effects are seen by the rest of
the fleet only when it ends (`start + step time`): its KV events reach the router's mirror
(through `Converter.convert`, the live path's conversion, then `ReplicaMirror.apply`) and its
finished requests release their dependents. At equal times step ends come before arrivals, so a
request sees every step that ended by then.

Tiers below the pools (`--host-capacity`, `--store-capacity`): each replica's manager has its
own host tier, and all of them share one store (a core `SharedTier` named "store": a block one
replica demotes there is a hit every replica's lookup sees and loads). Steps pay their loads in
the cost model; a replica's KV events carry its host tier's keys in vLLM's `medium` field, and
the store's own events, in the order its changes were decided, reach one `StoreMirror` that
every replica's mirror reads. The store's events are seen as the step that caused them starts:
an engine runs a step's tier ops before its forward, and only this order is the store's own
(steps of several replicas overlap in time and end in another order). The router prices a hit
loaded from a tier by the same cost model (`TierPrice`). With `score_tiers` off it hears only
device events, as one that reads no `medium` would.

Replicas sharing a store take their steps one at a time (kvreuse.core.tiers.shared): the
simulation decides one replica's whole step (`Scheduler.step`, sealed) before another's.

A replica's load follows the router's rule (`kvreuse.fleet.routing.router`): here every step is
seen, so it is the prompts of the requests routed to the replica and not yet admitted or waiting,
plus prompt and output so far of its running ones, as of its last step.
"""

from __future__ import annotations

import gc
import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvreuse.core import KVCacheManager, Request, SharedTier, TierSpec
from kvreuse.deployment import Deployment
from kvreuse.events import Converter, StoreMirror
from kvreuse.events.wire import BlockRemoved, WireEvent
from kvreuse.fleet import DEFAULT_LOAD_WEIGHT
from kvreuse.fleet.routing.query import TierPrice
from kvreuse.fleet.routing.router import Router
from kvreuse.fleet.simulation.feed import FleetFeeder
from kvreuse.fleet.simulation.summary import (
    FleetTally,
    Track,
    balance,
    fleet_tiers,
    prediction,
    reconcile,
    too_large,
)
from kvreuse.sched import DRAFT_ACCEPT_RATE, FakeEngine, FastForward, Scheduler, Seq, StepStats
from kvreuse.sim.blockchains import BlockChains
from kvreuse.sim.cost import CostMeter, CostModel
from kvreuse.sim.run import SimulationError
from kvreuse.sim.workload import WorkloadRequest
from kvreuse.tiering import STORE_TIER

Row = dict[str, Any]


@dataclass(frozen=True, slots=True)
class FleetOptions:
    """What a fleet run varies besides the deployment and the workload."""

    replicas: int
    policy: str = "exact"
    load_weight: float = DEFAULT_LOAD_WEIGHT
    cost: CostModel = field(default_factory=CostModel)
    draft_accept_rate: float = DRAFT_ACCEPT_RATE
    router_options: tuple[tuple[str, Any], ...] = ()  # text_threshold, text_imbalance, …
    score_tiers: bool = True  # the router hears the tiers' events and prices their loads
    fast_forward: bool = True  # each replica's decode steps call the core only at events

    def __post_init__(self) -> None:
        if type(self.replicas) is not int or not 1 <= self.replicas <= 1024:
            raise ValueError(f"--replicas must be an int in [1, 1024], got {self.replicas!r}")


@dataclass(slots=True)
class _Queued:
    request: Request
    max_tokens: int


class _Replica:
    """One simulated replica and the effects of its step in flight."""

    def __init__(
        self,
        index: int,
        dep: Deployment,
        below: list[TierSpec | SharedTier],
        cost: CostModel,
        accept_rate: float,
        tiers: bool,
        fast_forward: bool = True,
    ) -> None:
        self.index = index
        self.mgr = KVCacheManager(replace(dep.cache, enable_events=True), tiers=below)
        self.meter = CostMeter(FakeEngine(accept_rate=accept_rate), cost, self.mgr)
        self.sched = Scheduler(self.mgr, self.meter, dep.sched)
        script = self.meter.decode_script() if fast_forward else None
        self.fast = None if script is None else FastForward(self.sched, script)
        self.converter = Converter(self.mgr.geo, tiers=tiers)
        self.queue: deque[_Queued] = deque()  # routed, not yet handed to the scheduler
        self.queue_tokens = 0
        self.busy = False
        self.events: list[WireEvent] = []  # the step in flight's, seen when it ends
        self.done: list[Seq] = []
        self.admitted: list[str] = []
        self.num_removed = 0  # entries the published removals took away, so far
        self.peak_used = 0

    def has_work(self) -> bool:
        return bool(self.queue) or self.sched.has_work()

    def take_step(self) -> StepStats:
        """One step, as `Scheduler.step()` takes it: through the fast-forward where the batch
        allows (kvreuse.sched.advance: the core is called only at a request's events, and
        every step is still one step of this replica, with the same stats, events and
        timings), else the scheduler's own."""
        fast = self.fast
        if fast is not None and (fast.open or fast.begin()):
            st = fast.step()  # None: closed, everything up to date for the scheduler's step
            if st is not None:
                if not self.sched.has_work():
                    fast.close()
                return st
        return self.sched.step()

    def running_tokens(self) -> int:
        if self.fast is not None:
            return self.fast.num_running_tokens()
        return sum(s.num_tokens for s in self.sched.running)


def simulate_fleet(
    dep: Deployment,
    workload: list[WorkloadRequest],
    options: FleetOptions,
    sink: Callable[[Row], None] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, Any], list[Row]]:
    """Run `workload` on `options.replicas` replicas of `dep`; returns the summary and the rows
    (in workload order; empty when they went to `sink` as requests finished)."""
    kept: list[Row] = []
    run = _FleetRun(dep, workload, options, kept.append if sink is None else sink)
    was = gc.isenabled()
    gc.disable()  # as `kvreuse simulate` does: no cycles are built, and collections cost time
    try:
        run.loop(on_progress)
    finally:
        if was:
            gc.enable()
    return run.summary(), kept


class _FleetRun:
    def __init__(
        self,
        dep: Deployment,
        workload: list[WorkloadRequest],
        options: FleetOptions,
        sink: Callable[[Row], None],
    ) -> None:
        self.dep, self.workload, self.options = dep, workload, options
        cost, scored = options.cost, options.score_tiers and bool(dep.tiers)
        prices = {
            s.medium: TierPrice.of_rates(cost.prefill_tokens_per_s, *cost.tier_rate(s))
            for s in dep.tiers
        }
        self.router = Router(
            dep.cache,
            options.policy,
            load_weight=options.load_weight,
            tier_prices=prices,
            **dict(options.router_options),
        )
        spec = next((s for s in dep.tiers if s.name == STORE_TIER), None)
        self.store = None if spec is None else SharedTier(spec, dep.cache, enable_events=True)
        below = [self.store if s is spec and self.store is not None else s for s in dep.tiers]
        self.replicas = [
            _Replica(i, dep, below, cost, options.draft_accept_rate, scored, options.fast_forward)
            for i in range(options.replicas)
        ]
        media = [s.medium for s in dep.tiers] if scored else []
        self.store_mirror = None
        if self.store is not None and scored:
            self.store_mirror = StoreMirror(dep.cache.geometry, self.store.spec.medium)
        shared = [] if self.store_mirror is None else [self.store_mirror]
        for rep in self.replicas:
            self.router.add_replica(f"r{rep.index}", tiers=media, shared=shared)
        self.scored = scored
        self.store_converter = Converter(dep.cache.geometry)
        self.store_removed = 0  # keys the store's removals took away, so far
        chains = BlockChains(self.router.hasher, workload)
        self.feeder = FleetFeeder(workload, dep.max_model_len, chains)
        self.tally = FleetTally(options.replicas, sink)
        self.tracks: dict[str, Track] = {}
        self.heap: list[tuple[float, int, int]] = []  # (end time, tie-break, replica)
        self.num_events = 0
        self.clock = 0.0
        self.num_steps = 0

    def loop(self, on_progress: Callable[[int, int], None] | None) -> None:
        heap, feeder, total = self.heap, self.feeder, len(self.workload)
        while True:
            t_arrival = feeder.next_arrival()
            if heap and (t_arrival is None or heap[0][0] <= t_arrival):
                t, _, r = heapq.heappop(heap)
                self.clock = t
                self._end_step(self.replicas[r], t)
                if on_progress is not None:
                    on_progress(self.tally.num_rows, total)
            elif t_arrival is not None:
                self.clock = max(self.clock, t_arrival)
            else:
                break
            self._route_ready(self.clock)
            for rep in self.replicas:
                if not rep.busy and rep.has_work():
                    self._step(rep, self.clock)
        if self.tally.num_rows < total:
            left = total - self.tally.num_rows
            raise SimulationError(f"{left} requests wait on requests that never finish")

    def _route_ready(self, now: float) -> None:
        router = self.router
        for i, since, tokens, prefix in self.feeder.release(now):
            w = self.workload[i]
            query = router.query(
                tokens,
                request_id=w.request_id,
                lora=w.lora,
                cache_salt=w.cache_salt,
                prefix_hashes=prefix,
            )
            decision = router.route(query)
            r = decision.index
            rep = self.replicas[r]
            # the replica takes the router's chain: the same hasher's, so it hashes nothing again
            request = Request(
                w.request_id,
                tokens,
                lora=w.lora,
                cache_salt=w.cache_salt,
                prefix_hashes=query.chain.hashes[1:],
            )
            rep.queue.append(_Queued(request, w.max_tokens))
            rep.queue_tokens += len(tokens)
            router.set_load(r, router.load_tokens[r] + len(tokens), router.num_requests[r] + 1)
            self.tracks[w.request_id] = Track(
                index=i,
                replica=r,
                since=since,
                predicted=decision.predicted_cached,
                predicted_tiers=decision.predicted_tiers,
                removed_at_route=rep.num_removed + self.store_removed,
            )

    def _step(self, rep: _Replica, now: float) -> None:
        sched, tracks = rep.sched, self.tracks
        limit = sched.config.max_num_seqs
        while rep.queue and len(sched.waiting) < limit:
            q = rep.queue.popleft()
            sched.add(q.request, q.max_tokens)
            rep.queue_tokens -= len(q.request.prompt_token_ids)
        st = rep.take_step()
        self.num_steps += 1
        end = now + rep.meter.step_time(st.num_prefill_tokens, st.num_decode_tokens)
        rep.peak_used = max(rep.peak_used, st.num_used_blocks)
        self._store_changed()
        for rid in st.admitted:
            track = tracks[rid]
            if track.admitted_at is None:
                track.admitted_at = now
        for rid in st.first_output:  # (one that finished in this step ends at `end` too)
            track = tracks[rid]
            if track.first_token_at is None:
                track.first_token_at = end
        rep.done = [sched.pop_finished(rid) for rid in (*st.finished, *st.rejected)]
        rep.admitted = st.admitted
        rep.events = rep.converter.convert(rep.mgr.take_events())
        tokens = sum(s.prompt_len for s in sched.waiting) + rep.running_tokens()
        requests = len(sched.waiting) + len(sched.running) + len(rep.queue)
        self.router.set_load(rep.index, tokens + rep.queue_tokens, requests)
        rep.busy = True
        self.num_events += 1
        heapq.heappush(self.heap, (end, self.num_events, rep.index))

    def _store_changed(self) -> None:
        """The store's changes the step just decided, to its mirror (module docstring)."""
        if self.store is None:
            return
        events = self.store_converter.convert(self.store.take_events())
        self.store_removed += sum(
            len(ev.block_hashes) for ev in events if isinstance(ev, BlockRemoved)
        )
        if self.store_mirror is not None:
            self.store_mirror.apply(events)

    def _end_step(self, rep: _Replica, t: float) -> None:
        rep.busy = False
        events, rep.events = rep.events, []
        if events:
            for ev in events:
                if isinstance(ev, BlockRemoved):
                    rep.num_removed += len(ev.block_hashes)
            self.router.apply(rep.index, events)
        removed = rep.num_removed + self.store_removed
        for rid in rep.admitted:
            track = self.tracks[rid]
            if track.evicted is None:  # removals up to the end of the step that admitted it
                track.evicted = removed > track.removed_at_route
        rep.admitted = []
        for seq in rep.done:
            self.feeder.finished(seq, t)
            self.tally.finish(seq, self.tracks.pop(seq.request_id), t)
        rep.done = []

    def summary(self) -> dict[str, Any]:
        tally, options, reps = self.tally, self.options, self.replicas
        # the hit rate's denominator: the prompts of admitted requests, as a replica's counter
        prompt, cached = sum(tally.admitted_prompt), sum(tally.cached)
        managers = [rep.mgr for rep in reps]
        checks = reconcile(
            tally, managers, self.router.mirrors, len(self.workload), tiers=self.scored
        )
        per_replica = []
        for rep, mgr in zip(reps, managers, strict=True):
            r, m = rep.index, mgr.metrics()
            per_replica.append(
                {
                    "replica": f"r{r}",
                    "requests": tally.requests[r],
                    "prompt_tokens": tally.prompt_tokens[r],
                    "cached_tokens": tally.cached[r],
                    "hit_rate": tally.cached[r] / tally.admitted_prompt[r]
                    if tally.admitted_prompt[r]
                    else 0.0,
                    "evicted_blocks": m["kv_blocks_evicted_total"],
                    "peak_usage": rep.peak_used / (mgr.config.num_blocks - 1),
                }
            )
        timed = tally.num_timed
        return {
            "policy": options.policy,
            "replicas": options.replicas,
            "load_weight": options.load_weight,
            "requests": tally.num_rows,
            "prompt_tokens": sum(tally.prompt_tokens),
            "admitted_prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "tiers": fleet_tiers(self.dep.tiers, [rep.meter for rep in reps], tally, STORE_TIER),
            "balance": balance(tally.prompt_tokens),
            "prediction": prediction(tally),
            "per_replica": per_replica,
            "ttft_mean_s": round(tally.ttft_sum / timed, 6) if timed else None,
            "queue_mean_s": round(tally.queue_sum / timed, 6) if timed else None,
            "preemptions": tally.preemptions,
            "simulated_seconds": round(self.clock, 6),
            "steps": self.num_steps,
            "too_large": too_large(tally),
            "reconciliation": checks,
            "reconciled": all(checks.values()),
        }
