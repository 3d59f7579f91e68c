"""vLLM's v1 Scheduler and KVCacheManager built from a kvreuse deployment, for
`kvreuse simulate --engine vllm` (`kvreuse.sim.vllm_engine` runs it).

Groups become vLLM's KV cache specs (full -> FullAttentionSpec, sliding -> SlidingWindowSpec,
recurrent -> MambaSpec in "align" mode, as vLLM's Mamba-2 layer declares it), with the
deployment's block sizes, DCP size, hash unit (vLLM's prefix_match_unit), pool, batch and
sequence limits. What vLLM cannot express is refused before anything runs (`refusals`). vLLM
is imported only by `import_vllm` and `build_core`; its objects are typed Any here.
"""

from __future__ import annotations

import os
import types
from dataclasses import dataclass, field
from typing import Any

from kvreuse.deployment import Deployment
from kvreuse.sim.feed import static_length
from kvreuse.sim.workload import WorkloadRequest

INSTALL = (
    "vLLM is not importable here; build its venv with `bash benchmarks/vllm/setup_venv.sh` "
    "and run `.venv-vllm-anchor/bin/python -m kvreuse simulate --engine vllm ...`"
)
# kvreuse's hash algorithms -> vLLM's prefix_caching_hash_algo of the same function (the hash
# decides no hit by itself, but a run should hash as the deployment says)
HASH_ALGOS = {"sha256": "sha256", "sha256_cbor": "sha256_cbor", "xxh3_128": "xxhash"}
VOCAB = 32000  # the fake engine's (kvreuse.sched.FakeEngine)


class VllmRefusal(ValueError):
    """The deployment or an option cannot run on vLLM: one line naming what and what is allowed."""


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
