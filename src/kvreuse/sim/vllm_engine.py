"""`kvreuse simulate --engine vllm`: the same replay, with vLLM's own v1 `Scheduler` and
`KVCacheManager` deciding admission, chunking, preemption and every cache hit.

vLLM runs on the CPU with no model (as benchmarks/sim_anchor_vllm.py wires it): each step is
vLLM's `schedule()`, a fake model output (one token for each request whose scheduled tokens
reach its last token, the token kvreuse's fake engine would give, `token_at`; nothing for a
partial prefill chunk), then vLLM's `update_from_output()`. The arrivals, dependencies, the
clock and the cost model are the simulator's own (`kvreuse.sim.feed`, `kvreuse.sim.cost`); a
request's `cached_tokens` is what vLLM reports for it (its `prefill_stats.num_cached_tokens`,
the number vLLM's API returns as `prompt_tokens_details.cached_tokens`).

vLLM is imported only when this engine runs (`kvreuse.sim.vllm_build` builds its scheduler):
the rest of kvreuse never needs it, and its objects are typed Any here.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvreuse.deployment import Deployment
from kvreuse.sched import token_at
from kvreuse.sim.cost import CostModel
from kvreuse.sim.feed import Arrivals
from kvreuse.sim.tally import Tally
from kvreuse.sim.vllm_build import VOCAB, VllmCore, build_core, max_model_len
from kvreuse.sim.workload import WorkloadRequest

Row = dict[str, Any]

# Summary fields of kvreuse's engine that vLLM's side does not produce, and why.
NOT_PRODUCED = {
    "evicted_blocks": "vLLM's block pool counts no evictions on its scheduler side",
    "index_entries": "kvreuse's index only",
    "saved_states": "vLLM's Mamba align mode writes states inside the model runner",
    "deferral_waits": "kvreuse's scheduler only (in-batch deferral of a shared prefix)",
    "capacity_tokens": "kvreuse's pool arithmetic; vLLM's differs per group kind",
}


class VllmStuck(RuntimeError):
    """vLLM's scheduler can make no progress (requests wait on ones that never finish, or a
    step schedules nothing while requests wait)."""


@dataclass
class VllmResult:
    """What `simulate_vllm` returns: the summary and the tally (the report reads both)."""

    summary: dict[str, Any]
    tally: Tally
    timeline: list[tuple[float, float, float]] = field(default_factory=list)


class _Finished:
    """What `Arrivals.finished` reads of a finished request (kvreuse's Seq has the same)."""

    __slots__ = ("output", "request", "request_id")

    def __init__(self, request_id: str, prompt: list[int], output: list[int]) -> None:
        self.request_id = request_id
        self.request = types.SimpleNamespace(prompt_token_ids=prompt)
        self.output = output


def simulate_vllm(
    dep: Deployment,
    workload: list[WorkloadRequest],
    cost: CostModel,
    sink: Callable[[Row], None],
    on_step: Callable[[int, int], None] | None = None,
) -> VllmResult:
    """Replay `workload` through vLLM's scheduler built from `dep` (check_expressible first).

    Rows go to `sink` in workload order as requests finish, as `kvreuse.sim.run.simulate`'s."""
    max_len = max_model_len(dep, workload)
    core = build_core(dep, max_len)
    return _VllmRun(dep, workload, cost, core, sink, max_len).loop(on_step)


class _VllmRun:
    def __init__(
        self,
        dep: Deployment,
        workload: list[WorkloadRequest],
        cost: CostModel,
        core: VllmCore,
        sink: Callable[[Row], None],
        max_len: int,
    ) -> None:
        self.dep, self.workload, self.cost, self.core, self.sink = dep, workload, cost, core, sink
        self.arrivals = Arrivals(workload, max_len)
        self.ready: list[tuple[int, float]] = []
        self.arrived: dict[str, float] = {}
        self.first_step: dict[str, float] = {}
        self.first_token: dict[str, float] = {}
        self.cached: dict[str, int] = {}
        self.requests: dict[str, Any] = {}  # vLLM's Request by id, until finished
        self.finished: dict[int, Row] = {}
        self.next_row = 0
        self.tally = Tally()
        self.clock = 0.0
        self.steps = self.num_prefill = self.num_chunks = 0
        self.prefill_seconds = 0.0
        self.num_handed = 0
        self.timeline: list[tuple[float, float, float]] = []

    def _hand_over(self) -> None:
        """Ready requests into vLLM's waiting queue (vLLM bounds its own batch)."""
        core = self.core
        for i, since in self.ready:
            w = self.workload[i]
            tokens = self.arrivals.tokens(i).tolist()
            params = core.params_cls(max_tokens=w.max_tokens, ignore_eos=True, temperature=0.0)
            req = core.request_cls(
                w.request_id,
                tokens,
                params,
                None,
                arrival_time=since,
                block_hasher=core.hasher,
                cache_salt=w.cache_salt,
                lora_request=None,
            )
            core.scheduler.add_request(req)
            self.requests[w.request_id] = req
            self.arrived[w.request_id] = since
            self.num_handed += 1
        self.ready.clear()

    def loop(self, on_step: Callable[[int, int], None] | None) -> VllmResult:
        sched, n = self.core.scheduler, len(self.workload)
        while self.num_handed < n or sched.has_unfinished_requests():
            self.ready.extend(self.arrivals.due(self.clock))
            self._hand_over()
            if not sched.has_unfinished_requests():
                nxt = self.arrivals.next_arrival()
                if nxt is None:
                    raise VllmStuck(
                        f"{n - self.num_handed} requests wait on requests that never finish"
                    )
                self.clock = max(self.clock, nxt)
                continue
            self._step()
            if on_step is not None:
                on_step(self.tally.num_rows + len(self.finished), n)
        return VllmResult(self._summary(), self.tally, self.timeline)

    def _step(self) -> None:
        core, start = self.core, self.clock
        out = core.scheduler.schedule()
        if not out.num_scheduled_tokens and not core.scheduler.running:
            waiting = len(self.requests)
            raise VllmStuck(
                f"vLLM's scheduler scheduled nothing with {waiting} requests waiting "
                "(the pool is too small for them); raise num_blocks"
            )
        self.steps += 1
        ids, sampled = [], []
        prefill = decode = chunks = 0
        for rid, k in out.num_scheduled_tokens.items():
            r = self.requests[rid]
            self.first_step.setdefault(rid, start)
            if k == 1 and r.num_output_tokens > 0 and r.num_computed_tokens == r.num_tokens - 1:
                decode += 1
            else:
                prefill += k
                chunks += 1
            ids.append(rid)
            # a partial prefill chunk samples nothing; otherwise one token, kvreuse's fake
            # engine's for this request and position
            done = r.num_computed_tokens + k >= r.num_tokens
            sampled.append([token_at(rid, r.num_tokens, VOCAB)] if done else [])
        result = core.output_cls(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        outputs = core.scheduler.update_from_output(out, result)
        dt = self.cost.step_time(prefill, decode, 0, chunks)
        self.clock += dt
        self.prefill_seconds += dt - (self.cost.decode_step_s if decode else 0.0)
        self.num_prefill += prefill
        self.num_chunks += chunks
        finished: list[str] = []
        for eco in outputs.values():
            for o in eco.outputs:
                if o.prefill_stats is not None:
                    self.cached.setdefault(o.request_id, o.prefill_stats.num_cached_tokens)
                if o.new_token_ids:
                    self.first_token.setdefault(o.request_id, self.clock)
                if o.finish_reason is not None:
                    finished.append(o.request_id)
        for rid in finished:
            self._finish(rid)
        stats = core.scheduler.kv_cache_manager.prefix_cache_stats
        usage = core.scheduler.kv_cache_manager.usage
        self.timeline.append(
            (self.clock, usage, stats.hits / stats.queries if stats.queries else 0.0)
        )

    def _finish(self, rid: str) -> None:
        r = self.requests.pop(rid)
        output = list(r.output_token_ids)
        self.arrivals.finished(_Finished(rid, list(r.prompt_token_ids), output), self.clock)  # type: ignore[arg-type]
        arrived = self.arrived.pop(rid)
        admitted = self.first_step.pop(rid)
        first = self.first_token.pop(rid, self.clock)
        row = {
            "id": rid,
            "prompt_tokens": r.num_prompt_tokens,
            "cached_tokens": self.cached.pop(rid, 0),
            "output_tokens": len(output),
            "preemptions": r.num_preemptions,
            "finish_reason": "length",
            "queue_s": round(admitted - arrived, 6),
            "ttft_estimate_s": round(first - arrived, 6),
        }
        self.finished[self.arrivals.index[rid]] = row
        while self.next_row in self.finished:  # rows leave in workload order
            row = self.finished.pop(self.next_row)
            self.sink(row)
            self.tally.add(row, True)
            self.next_row += 1

    def _summary(self) -> dict[str, Any]:
        stats = self.core.scheduler.kv_cache_manager.prefix_cache_stats
        tally = self.tally
        # vLLM's counters leave a preempted request's second lookup apart, as the rows do
        checks = {
            "cached_tokens_equal_hits": tally.cached_tokens == stats.hits,
            "prompts_equal_queries": tally.admitted_prompt_tokens == stats.queries,
            "every_request_finished": tally.num_rows == len(self.workload),
        }
        return {
            "engine": "vllm",
            "vllm": self.core.facts,
            "requests": tally.num_rows,
            "queries": stats.queries,
            "hits": stats.hits,
            "hit_rate": stats.hits / max(1, stats.queries),
            "preemptions": tally.preemptions,
            "simulated_seconds": round(self.clock, 6),
            "reconciliation": checks,
            "reconciled": all(checks.values()),
            "too_large": {"count": 0, "ids": []},
            "steps": self.steps,
            "prefill_tokens_computed": self.num_prefill,
            "prefill_chunks": self.num_chunks,
            "prefill_seconds": round(self.prefill_seconds, 6),
            "not_produced": NOT_PRODUCED,
        }
