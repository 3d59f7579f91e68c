"""What a fleet run reports: fleet and per-replica hit rates, the load balance (spread of routed
prompt tokens: max / mean and the coefficient of variation), predicted vs delivered cached
tokens, and one table comparing policies side by side.

Rows leave in workload order as requests finish (a sink writes them), so a run keeps totals,
not rows.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.core import KVCacheManager, TierSpec
from kvreuse.events import ReplicaMirror, hash64
from kvreuse.sched import Seq
from kvreuse.sim.cost import CostMeter
from kvreuse.vocab import percent, plural

NAMED_TOO_LARGE = 10


@dataclass(slots=True)
class Track:
    """A routed request, from its routing to its finish."""

    index: int  # in the workload
    replica: int
    since: float  # ready (arrived, dependencies finished)
    predicted: int | None  # the policy's prediction for the chosen replica
    removed_at_route: int  # the replica's and the store's removals so far when it was routed
    admitted_at: float | None = None
    first_token_at: float | None = None
    evicted: bool | None = None  # did the replica or the store remove entries in between
    predicted_tiers: tuple[int, ...] | None = None  # of the prediction, per tier below the pool


class FleetTally:
    """Totals over finished requests; rows go to `sink` in workload order."""

    def __init__(self, num_replicas: int, sink: Callable[[dict[str, Any]], None]) -> None:
        self.sink = sink
        self.waiting: dict[int, dict[str, Any]] = {}  # finished rows, until their turn
        self.next_row = 0
        self.num_rows = 0
        zeros = [0] * num_replicas
        self.requests, self.prompt_tokens, self.cached = zeros[:], zeros[:], zeros[:]
        self.admitted, self.admitted_prompt = zeros[:], zeros[:]
        self.preemptions = 0
        self.num_predicted = self.abs_error = self.num_over = self.over_tokens = 0
        self.max_over = self.num_under = self.clean_mismatch = self.clean_over = 0
        self.ttft_sum = self.queue_sum = 0.0
        self.num_timed = 0
        self.too_large: list[str] = []
        self.num_too_large = 0
        # per tier below the pools: tokens predicted and delivered from it, and the requests
        # whose per-tier split differed with nothing removed between routing and admission
        self.tier_predicted: list[int] = []
        self.tier_delivered: list[int] = []
        self.tier_clean_mismatch = 0

    def finish(self, seq: Seq, track: Track, t: float) -> None:
        r = track.replica
        cached = seq.stats.cached_tokens if seq.stats else 0
        rejected = seq.finish_reason == "too_large"
        self.requests[r] += 1
        self.prompt_tokens[r] += seq.prompt_len
        self.cached[r] += cached
        self.preemptions += seq.preemptions
        if seq.cached_tokens is not None:  # admitted: the core counted it
            self.admitted[r] += 1
            self.admitted_prompt[r] += seq.prompt_len
            if track.predicted is not None:
                self._predicted(track.predicted, cached, bool(track.evicted))
            if track.predicted_tiers is not None and seq.stats is not None:
                self._predicted_tiers(track, seq.stats.tier_tokens)
        queue_s = ttft_s = None
        if rejected:
            self.num_too_large += 1
            if len(self.too_large) < NAMED_TOO_LARGE:
                self.too_large.append(seq.request_id)
        elif track.admitted_at is not None:
            queue_s = track.admitted_at - track.since
            # no first token recorded: it came in the step that finished the request
            ttft_s = (track.first_token_at or t) - track.since
            self.num_timed += 1
            self.queue_sum += queue_s
            self.ttft_sum += ttft_s
        pt = track.predicted_tiers
        delivered = seq.stats.tier_tokens if seq.stats else ()
        row = {
            "id": seq.request_id,
            "replica": f"r{r}",
            "prompt_tokens": seq.prompt_len,
            "cached_tokens": cached,
            "predicted_tokens": track.predicted,
            "predicted_tiers": None if pt is None else list(pt),
            "delivered_tiers": None if pt is None else list(delivered or (0,) * len(pt)),
            "evicted_before_admission": track.evicted,
            "reason": seq.stats.reason if seq.stats else "not_admitted",
            "output_tokens": len(seq.output),
            "preemptions": seq.preemptions,
            "finish_reason": seq.finish_reason,
            "queue_s": None if queue_s is None else round(queue_s, 6),
            "ttft_estimate_s": None if ttft_s is None else round(ttft_s, 6),
        }
        self.waiting[track.index] = row
        while self.next_row in self.waiting:
            self.sink(self.waiting.pop(self.next_row))
            self.next_row += 1
        self.num_rows += 1

    def _predicted_tiers(self, track: Track, delivered: tuple[int, ...]) -> None:
        predicted = track.predicted_tiers or ()
        if not self.tier_predicted:
            self.tier_predicted = [0] * len(predicted)
            self.tier_delivered = [0] * len(predicted)
        got = delivered or (0,) * len(predicted)  # a request that loaded nothing
        for t, (p, d) in enumerate(zip(predicted, got, strict=True)):
            self.tier_predicted[t] += p
            self.tier_delivered[t] += d
        if not track.evicted and tuple(got) != tuple(predicted):
            self.tier_clean_mismatch += 1

    def _predicted(self, predicted: int, delivered: int, evicted: bool) -> None:
        self.num_predicted += 1
        error = predicted - delivered
        self.abs_error += abs(error)
        if error > 0:
            self.num_over += 1
            self.over_tokens += error
            self.max_over = max(self.max_over, error)
        elif error < 0:
            self.num_under += 1
        if not evicted and error:
            self.clean_mismatch += 1
            self.clean_over += error > 0


def balance(routed: Sequence[int]) -> dict[str, Any]:
    """Spread of the prompt tokens routed to each replica: max / mean and the coefficient of
    variation (population standard deviation / mean); 1 and 0 are a perfect balance."""
    mean = sum(routed) / len(routed) if routed else 0
    return {
        "routed_prompt_tokens": list(routed),
        "max_over_mean": round(max(routed) / mean, 4) if mean else None,
        "cv": round(statistics.pstdev(routed) / mean, 4) if mean else None,
    }


def fleet_tiers(
    specs: Sequence[TierSpec], meters: Sequence[CostMeter], tally: FleetTally, shared: str
) -> dict[str, Any] | None:
    """Per tier below the replicas' pools, summed over the fleet: the hit tokens it gave back,
    the blocks it loaded and the simulated seconds of those loads, what it holds at the end;
    with the router's prediction of those tokens beside what was delivered (None: no tiers).
    The tier named `shared` is one the replicas share: its capacity and holdings are counted
    once; another tier's capacity is each replica's."""
    if not specs:
        return None
    out: dict[str, Any] = {}
    per_meter = [m.summary()["tiers"] for m in meters]
    for t, spec in enumerate(specs):
        rows = [tiers[spec.name] for tiers in per_meter]
        one = spec.name == shared
        out[spec.name] = {
            "medium": spec.medium,
            "shared": one,
            "capacity_blocks": spec.num_blocks,  # the store's, or each replica's
            "held_blocks": rows[0]["held_blocks"] if one else sum(r["held_blocks"] for r in rows),
            "hit_tokens": sum(r["hit_tokens"] for r in rows),
            "loaded_blocks": sum(r["loaded_blocks"] for r in rows),
            "load_seconds": round(sum(r["load_seconds"] for r in rows), 6),
            "predicted_hit_tokens": tally.tier_predicted[t] if tally.tier_predicted else None,
            "delivered_hit_tokens": tally.tier_delivered[t] if tally.tier_delivered else None,
        }
    if tally.tier_predicted:
        out["split_mismatched_without_eviction"] = tally.tier_clean_mismatch
    return out


def _tiers_match(mgr: KVCacheManager, mirror: ReplicaMirror) -> bool:
    """The router's mirror holds exactly the keys each of the replica's tiers holds."""
    held: dict[tuple[int, int], set[int]] = {}
    for t, gid, _b, key, _slot in mgr.tiers.export_entries():
        held.setdefault((t, gid), set()).add(hash64(key))
    if len(mirror.media) != len(mgr.tiers.tiers):
        return False
    return all(
        set(mirror.tier_entries(t, g.group_id)) == held.get((t, g.group_id), set())
        for t in range(len(mirror.media))
        for g in mgr.geo.groups
    )


def _mirror_matches(mgr: KVCacheManager, mirror: ReplicaMirror) -> bool:
    """The router's mirror holds exactly the replica's resident entries (wire keys)."""
    resident: dict[int, dict[int, int]] = {g.group_id: {} for g in mgr.geo.groups}
    for gid, boundary, key, _kind, _block in mgr.export_entries():
        resident[gid][hash64(key)] = boundary
    return all(mirror.entries(gid) == entries for gid, entries in resident.items())


def reconcile(
    tally: FleetTally,
    managers: Sequence[KVCacheManager],
    mirrors: Sequence[ReplicaMirror],
    total: int,
    *,
    tiers: bool = False,
) -> dict[str, bool]:
    """Per replica: Σ cached == Δ hits and Σ admitted prompts == Δ queries (exact), the core's
    audit, and the mirror equal to the replica's entries (and, with `tiers`, to each tier's
    keys); every request finished."""
    checks = {"every_request_finished": tally.num_rows == total}
    for r, mgr in enumerate(managers):
        c = mgr.stats.counters
        checks[f"r{r}_cached_tokens_equal_hits"] = tally.cached[r] == c["prefix_cache_hits"]
        checks[f"r{r}_prompts_equal_queries"] = (
            tally.admitted_prompt[r] == c["prefix_cache_queries"]
        )
        checks[f"r{r}_admitted_equal_requests"] = tally.admitted[r] == c["prefix_cache_requests"]
        try:
            mgr.check_invariants()
            checks[f"r{r}_invariants"] = True
        except AssertionError:
            checks[f"r{r}_invariants"] = False
        checks[f"r{r}_mirror_equals_replica"] = _mirror_matches(mgr, mirrors[r])
        if tiers:
            checks[f"r{r}_mirror_tiers_equal_replica"] = _tiers_match(mgr, mirrors[r])
    return checks


def prediction(tally: FleetTally) -> dict[str, Any] | None:
    """Predicted vs delivered cached tokens over the admitted requests (None: the policy does
    not predict). `*_without_eviction`: requests whose replica removed nothing between their
    routing and the end of the step that admitted them."""
    n = tally.num_predicted
    if not n:
        return None
    return {
        "requests": n,
        "mean_abs_error_tokens": round(tally.abs_error / n, 3),
        "over_predicted": tally.num_over,
        "over_predicted_tokens": tally.over_tokens,
        "max_over_prediction_tokens": tally.max_over,
        "under_predicted": tally.num_under,
        "mismatched_without_eviction": tally.clean_mismatch,
        "over_predicted_without_eviction": tally.clean_over,
    }


def too_large(tally: FleetTally) -> dict[str, Any]:
    return {"count": tally.num_too_large, "ids": tally.too_large}


def _pct(value: float | None) -> str:
    return "—" if value is None else percent(value, 1)


def comparison_table(summaries: Sequence[dict[str, Any]]) -> str:
    """One row per policy: reuse, balance, prediction error, the TTFT estimate."""
    below = any(s.get("tiers") for s in summaries)
    head = f"{'policy':<16} {'hit rate':>8} "
    head += f"{'from tiers':>10} {'load (s)':>9} " if below else ""
    head += (
        f"{'cached tokens':>14} {'max/mean':>8} {'CV':>6} {'pred. MAE':>10} {'over-pred.':>10} "
        f"{'TTFT (s)':>9}"
    )
    lines = [head]
    for s in summaries:
        b, p = s["balance"], s["prediction"]
        line = f"{s['policy']:<16} {_pct(s['hit_rate']):>8} "
        if below:
            rows = [v for v in (s.get("tiers") or {}).values() if isinstance(v, dict)]
            got = sum(v["hit_tokens"] for v in rows)
            share = got / s["admitted_prompt_tokens"] if s["admitted_prompt_tokens"] else None
            load = sum(v["load_seconds"] for v in rows)
            line += f"{_pct(share):>10} {load:>9,.1f} "
        mae = "—" if p is None else f"{p['mean_abs_error_tokens']:,.1f}"
        over = "—" if p is None else f"{p['over_predicted']:,}"
        ttft = "—" if s["ttft_mean_s"] is None else f"{s['ttft_mean_s']:.3f}"
        mm = "—" if b["max_over_mean"] is None else f"{b['max_over_mean']:.2f}"
        cv = "—" if b["cv"] is None else f"{b['cv']:.2f}"
        line += f"{s['cached_tokens']:>14,} {mm:>8} {cv:>6} {mae:>10} {over:>10} {ttft:>9}"
        lines.append(line)
    lines.append(denominator_note(summaries))
    return "\n".join(lines)


def denominator_note(summaries: Sequence[dict[str, Any]]) -> str:
    """What the hit rate counts, and the requests it leaves out (the same in every run)."""
    note = "hit rate: cached / prompt tokens of the admitted requests"
    refused = max((s["too_large"]["count"] for s in summaries), default=0)
    if refused:
        left = max(s["prompt_tokens"] - s["admitted_prompt_tokens"] for s in summaries)
        note += (
            f"; it leaves out {plural(refused, 'request')} never admitted ({left:,} prompt tokens)"
        )
    return note
