"""`kvreuse simulate --engine vllm`: the same replay, with vLLM's own v1 `Scheduler` and
`KVCacheManager` deciding admission, chunking, preemption and every cache hit.

vLLM runs on the CPU with no model (as benchmarks/sim_anchor_vllm.py wires it): each step is
vLLM's `schedule()`, a fake model output (one token for each request whose scheduled tokens
reach its last token, the token kvreuse's fake engine would give, `token_at`; nothing for a
partial prefill chunk), then vLLM's `update_from_output()`. The arrivals, dependencies, the
clock and the cost model are the simulator's own (`kvreuse.sim.feed`, `kvreuse.sim.cost`); a
request's `cached_tokens` is what vLLM reports for it (its `prefill_stats.num_cached_tokens`,
the number vLLM's API returns as `prompt_tokens_details.cached_tokens`).

vLLM is imported only here, and only when this engine runs: the rest of kvreuse never needs it.
Its objects cross this module's boundary typed as Any. A deployment vLLM cannot express is
refused before anything runs (`VllmRefusal`, one line naming the field and what is allowed).
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvreuse.deployment import Deployment
from kvreuse.sched import token_at
from kvreuse.sim.cost import CostModel
from kvreuse.sim.feed import Arrivals, static_length
from kvreuse.sim.tally import Tally
from kvreuse.sim.workload import WorkloadRequest

Row = dict[str, Any]

INSTALL = (
    "vLLM is not importable here; build its venv with `bash benchmarks/vllm/setup_venv.sh` "
    "and run `.venv-vllm-anchor/bin/python -m kvreuse simulate --engine vllm ...`"
)
# kvreuse's hash algorithms -> vLLM's prefix_caching_hash_algo of the same function (the hash
# decides no hit by itself, but a run should hash as the deployment says)
HASH_ALGOS = {"sha256": "sha256", "sha256_cbor": "sha256_cbor", "xxh3_128": "xxhash"}
VOCAB = 32000  # the fake engine's (kvreuse.sched.FakeEngine)
# Summary fields of kvreuse's engine that vLLM's side does not produce, and why.
NOT_PRODUCED = {
    "evicted_blocks": "vLLM's block pool counts no evictions on its scheduler side",
    "index_entries": "kvreuse's index only",
    "saved_states": "vLLM's Mamba align mode writes states inside the model runner",
    "deferral_waits": "kvreuse's scheduler only (in-batch deferral of a shared prefix)",
    "capacity_tokens": "kvreuse's pool arithmetic; vLLM's differs per group kind",
}


class VllmRefusal(ValueError):
    """The deployment or an option cannot run on vLLM: one line naming what and what is allowed."""


class VllmStuck(RuntimeError):
    """vLLM's scheduler can make no progress (requests wait on ones that never finish, or a
    step schedules nothing while requests wait)."""


def refusals(dep: Deployment) -> list[str]:
    """Why `dep` cannot be built as vLLM's scheduler, one line per field (empty: it can)."""
    cache, sched, out = dep.cache, dep.sched, []
    # speculative decoding first: it also explains the drafter groups named after it
    if cache.spec_mode != "none" or sched.num_spec_tokens:
        out.append(
            f"spec_mode = {cache.spec_mode!r}, num_spec_tokens = {sched.num_spec_tokens}: "
            "speculative decoding is kvreuse's engine only; allowed: 'none' and 0"
        )
    allowed_kinds = "full, sliding, recurrent"
    for g in cache.geometry.groups:
        where = f"group {g.group_id} ({g.kind})"
        if g.kind not in ("full", "sliding", "recurrent"):
            out.append(
                f"{where}: vLLM's prefix cache has no {g.kind} group kind in kvreuse's "
                f"sense; allowed kinds: {allowed_kinds}"
            )
        if g.role != "target":
            out.append(f"{where}: role {g.role!r}; allowed: 'target' (no drafter groups)")
        if not g.cacheable:
            out.append(f"{where}: prefix_cacheable = false; allowed: true")
        if g.scratch:
            out.append(f"{where}: state_scratch_blocks = {g.scratch}; allowed: 0")
        if g.kind == "recurrent" and g.sharded:
            out.append(f"{where}: dcp_sharded = true; vLLM keeps Mamba states replicated")
    if cache.hash_algo not in HASH_ALGOS:
        out.append(f"hash_algo = {cache.hash_algo!r}; allowed: {', '.join(HASH_ALGOS)}")
    if cache.hash_seed is not None:
        out.append("hash_seed: vLLM's hashes take no seed; allowed: unset")
    if cache.admission_watermark_blocks:
        out.append(f"admission_watermark_blocks = {cache.admission_watermark_blocks}; allowed: 0")
    if cache.eviction_policy != "lru":
        out.append(f"eviction_policy = {cache.eviction_policy!r}; allowed: 'lru'")
    if dep.tiers:
        out.append("memory tiers below the pool are kvreuse's engine only; allowed: none")
    return out


def check_expressible(dep: Deployment) -> None:
    """Raise VllmRefusal with the first reason `dep` cannot run on vLLM."""
    problems = refusals(dep)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise VllmRefusal(f"--engine vllm cannot express {dep.name}: {problems[0]}{more}")


def import_vllm() -> types.ModuleType:
    """vLLM, or VllmRefusal naming the install step."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the summary
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import vllm
        import vllm.v1.core.sched.scheduler  # the v1 scheduler must load too
    except ImportError:
        raise VllmRefusal(INSTALL) from None
    return vllm


def max_model_len(dep: Deployment, workload: list[WorkloadRequest]) -> int:
    """vLLM needs a context length: the deployment's, else the longest request the workload
    states (a prompt quoting a history counts as the pool's capacity)."""
    if dep.max_model_len is not None:
        return dep.max_model_len
    longest = 1
    for w in workload:
        n = static_length(w.prompt)
        if n is None:
            cap = dep.cache.capacity_tokens()
            return max(longest, cap if cap else 1 << 20)
        longest = max(longest, n + w.max_tokens)
    return longest


@dataclass
class VllmCore:
    """vLLM's scheduler built from a deployment, the block hasher its Requests need, and the
    classes a step uses."""

    scheduler: Any
    hasher: Any
    request_cls: Any
    params_cls: Any
    output_cls: Any
    facts: dict[str, Any] = field(default_factory=dict)


def _model_stand_in(max_len: int) -> types.SimpleNamespace:
    """What vLLM's Scheduler and StructuredOutputManager read of a ModelConfig, which needs a
    Hugging Face model to be built: a text-only decoder that generates."""
    return types.SimpleNamespace(
        max_model_len=max_len, runner_type="generate", uses_mrope=False,
        is_encoder_decoder=False, is_diffusion=False, supports_multimodal_inputs=False,
        multimodal_config=None, return_sampling_mask=False, skip_tokenizer_init=True,
        get_vocab_size=lambda: VOCAB,
    )  # fmt: skip


def build_core(dep: Deployment, max_len: int) -> VllmCore:
    """vLLM's v1 Scheduler and KVCacheManager for `dep` (check_expressible first)."""
    vllm = import_vllm()
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ParallelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.metrics.stats import PrefixCacheStats
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    cache, sched = dep.cache, dep.sched
    groups = cache.geometry.groups
    recurrent = [g for g in groups if not g.is_attention]
    caching = cache.enable_prefix_caching
    attn = {"num_kv_heads": 1, "head_size": 64, "dtype": torch.float16}  # bytes: never read
    specs: list[Any] = []
    for g in groups:
        if g.kind == "full":
            specs.append(FullAttentionSpec(block_size=g.block_size, dcp_sharded=g.sharded, **attn))
        elif g.kind == "sliding":
            specs.append(
                SlidingWindowSpec(
                    block_size=g.block_size, dcp_sharded=g.sharded, sliding_window=g.window, **attn
                )
            )
        else:
            specs.append(
                MambaSpec(
                    block_size=g.block_size,
                    shapes=((1,),),
                    dtypes=(torch.float16,),
                    mamba_cache_mode="align" if caching else "none",
                    # as vLLM's Mamba-2 layer declares its spec: the state at a block
                    # boundary inside a prefill chunk can be exported, at any position
                    num_prefill_checkpoint_blocks=1,
                    prefill_checkpoint_alignment=1,
                )
            )
    sched_cfg = SchedulerConfig(
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=max_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,  # schedule -> output -> update, in lockstep
    )
    attention_block = next((g.block_size for g in groups if g.is_attention), groups[0].block_size)
    cache_cfg = CacheConfig(
        block_size=attention_block,
        enable_prefix_caching=caching,
        prefix_caching_hash_algo=HASH_ALGOS[cache.hash_algo],
        # kvreuse's recurrent_retention "dense" keeps a state at every page: vLLM's None
        # ("retains checkpoints densely"); "sparse": vLLM's 0 (semantic checkpoints only)
        prefix_cache_retention_interval=None if cache.recurrent_retention == "dense" else 0,
    )
    if recurrent:
        cache_cfg.mamba_cache_mode = "align" if caching else "none"
        cache_cfg.mamba_block_size = recurrent[0].block_size
    if len(groups) > 1 and cache.hash_unit is not None:
        cache_cfg.prefix_match_unit = cache.geometry.hash_unit
    dcp = cache.dcp_size
    parallel = ParallelConfig(tensor_parallel_size=dcp, decode_context_parallel_size=dcp)
    config = VllmConfig(
        scheduler_config=sched_cfg,
        cache_config=cache_cfg,
        device_config=DeviceConfig("cpu"),
        parallel_config=parallel,
    )
    config.model_config = _model_stand_in(max_len)
    cache_cfg.num_gpu_blocks = cache.num_blocks  # the engine sets it after profiling memory
    kv_cfg = KVCacheConfig(
        num_blocks=cache.num_blocks,  # both count the null block in the pool
        kv_cache_tensors=[],  # device memory layout: never read on the scheduler side
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=[f"layer.{i}"], kv_cache_spec=s)
            for i, s in enumerate(specs)
        ],
        prefix_cache_retention_interval=cache_cfg.prefix_cache_retention_interval,
    )
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv_cfg, config)
    kv_cfg.hash_block_size = hash_bs
    kv_cfg.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv_cfg, config, sched_bs, hash_bs
    )
    scheduler_cls = sched_cfg.get_scheduler_cls()
    scheduler = scheduler_cls(
        vllm_config=config,
        kv_cache_config=kv_cfg,
        structured_output_manager=StructuredOutputManager(config),
        block_size=sched_bs,
        hash_block_size=hash_bs,
        log_stats=False,
    )
    manager = scheduler.kv_cache_manager
    # the manager's prefix-hit counters only (the summary's queries and hits)
    manager.log_stats, manager.prefix_cache_stats = True, PrefixCacheStats()
    hash_fn = get_hash_fn_by_name(cache_cfg.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_bs, hash_fn, config.num_hash_lookahead_tokens)
    facts = {
        "vllm_version": vllm.__version__,
        "scheduler_cls": scheduler_cls.__name__,
        "coordinator_cls": type(manager.coordinator).__name__,
        "scheduler_block_size": sched_bs,
        "hash_block_size": hash_bs,
        "cache_hit_alignment_tokens": kv_cfg.cache_hit_alignment_tokens,
        "dcp_size": dcp,
        "max_model_len": max_len,
    }
    return VllmCore(scheduler, hasher, Request, SamplingParams, ModelRunnerOutput, facts)


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
