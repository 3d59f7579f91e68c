#!/usr/bin/env python3
"""vLLM anchor for `sim_bench.py`: simulated requests per second of vLLM's own v1 scheduler.

Drives vLLM's v1 `Scheduler` and its `KVCacheManager` on CPU with no model. Each step is
`schedule()`, a fake model output (one token for each request whose scheduled tokens reach its
last known token, nothing for a partial prefill chunk), then `update_from_output()`, until all
requests finish. This file holds no vLLM code: it only imports vLLM (run it with
`.venv-vllm-anchor/bin/python`) and wires its classes together as vLLM's engine core does.

Workload as in `sim_bench.py`: N requests arriving at once; 2,048-token prompts = a shared
1,024-token prefix + 1,024 tokens per request (`random.Random`, vocab 32,768); 64 output tokens
each (ignore_eos). "Plain attention-16": one full-attention group, block 16, 8,192 blocks,
prefix caching with CacheConfig's default hash; max_num_seqs 256, max_num_batched_tokens 8,192,
chunked prefill, synchronous scheduling, no speculative decoding.

Timed (wall: perf_counter, CPU: process_time): `add_request` of every request plus the step
loop, with the garbage collector paused (as `kvreuse simulate` does). Building the Request
objects (vLLM hashes their blocks then) is timed apart and reported in params.

No Hugging Face model is available offline, and vLLM's `ModelConfig` needs one, so `VllmConfig`
is built from real Scheduler/Cache/Device configs and `model_config=None`; a stand-in then gives
the few model facts the scheduler reads (see `model_stand_in`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
import types
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # keep stdout for results
os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    import vllm
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.interface import SchedulerInterface
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.metrics.stats import PrefixCacheStats
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.structured_output import StructuredOutputManager
except ImportError as exc:  # pragma: no cover - environment guard
    sys.exit(f"cannot import vLLM ({exc}); run with .venv-vllm-anchor/bin/python")

import torch

VOCAB = 1 << 15
PROMPT, PREFIX, MAX_TOKENS = 2048, 1024, 64
BLOCK, NUM_BLOCKS = 16, 8192
MAX_NUM_SEQS, MAX_BATCHED = 256, 8192
MAX_MODEL_LEN = 4096  # ≥ 2,048 + 64
FIXED = {  # the workload and geometry, echoed in every record
    "prompt_tokens": PROMPT, "shared_prefix": PREFIX, "max_tokens": MAX_TOKENS,
    "block_size": BLOCK, "num_blocks": NUM_BLOCKS, "max_num_seqs": MAX_NUM_SEQS,
    "max_num_batched_tokens": MAX_BATCHED, "max_model_len": MAX_MODEL_LEN, "gc_paused": True,
    "vllm_version": vllm.__version__, "model_config": "stand-in (no HF model)",
}  # fmt: skip


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_stand_in() -> types.SimpleNamespace:
    """What the Scheduler and StructuredOutputManager read from ModelConfig: a text-only
    decoder that generates (no mrope, encoder, multimodal input, diffusion or tokenizer)."""
    return types.SimpleNamespace(
        max_model_len=MAX_MODEL_LEN, runner_type="generate", uses_mrope=False,
        is_encoder_decoder=False, is_diffusion=False, supports_multimodal_inputs=False,
        multimodal_config=None, return_sampling_mask=False, skip_tokenizer_init=True,
        get_vocab_size=lambda: VOCAB,
    )  # fmt: skip


def build_scheduler() -> tuple[SchedulerInterface, Any, dict[str, Any]]:
    """The scheduler, the block hasher requests are built with, and facts for params."""
    sched_cfg = SchedulerConfig(
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_BATCHED,
        max_model_len=MAX_MODEL_LEN,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,  # plain Scheduler: schedule -> output -> update, in lockstep
    )
    cache_cfg = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    config = VllmConfig(
        scheduler_config=sched_cfg, cache_config=cache_cfg, device_config=DeviceConfig("cpu")
    )
    config.model_config = model_stand_in()  # see the module docstring
    # The engine sets this after profiling memory; here the pool size is fixed.
    cache_cfg.num_gpu_blocks = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16)
    kv_cfg = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],  # device memory layout: never read on the scheduler side
        kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)],
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
        log_stats=False,  # offline LLM default; prefix-hit counters are switched on below
    )
    # Only the KV cache manager's prefix-hit counters (a few additions per lookup), not the
    # scheduler's per-request event logging; nothing resets them when log_stats is off.
    manager = scheduler.kv_cache_manager
    manager.log_stats, manager.prefix_cache_stats = True, PrefixCacheStats()
    algo = cache_cfg.prefix_caching_hash_algo
    hash_fn = get_hash_fn_by_name(algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_bs, hash_fn, config.num_hash_lookahead_tokens)
    facts = {
        "scheduler_cls": scheduler_cls.__name__, "hash_algo": algo,
        "scheduler_block_size": sched_bs, "hash_block_size": hash_bs,
        "use_v2_model_runner": bool(config.use_v2_model_runner),  # shapes SchedulerOutput
    }  # fmt: skip
    return scheduler, hasher, facts


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prefix from seed `seed`, request i's suffix from seed `seed + 1 + i`."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(PREFIX)]
    prompts = []
    for i in range(n):
        rng = random.Random(seed + 1 + i)
        prompts.append(prefix + [rng.randrange(VOCAB) for _ in range(PROMPT - PREFIX)])
    return prompts


def make_requests(prompts: list[list[int]], hasher: Any) -> list[Request]:
    """vLLM computes a request's block hashes when the Request is built."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    return [
        Request(str(i), p, params, None, arrival_time=0.0, block_hasher=hasher)
        for i, p in enumerate(prompts)
    ]


def run_once(n: int) -> dict[str, Any]:
    scheduler, hasher, facts = build_scheduler()
    prompts = make_prompts(n)
    t0, c0 = time.perf_counter(), time.process_time()
    reqs = make_requests(prompts, hasher)  # timed apart: Request objects + block hashes
    build_wall, build_cpu = time.perf_counter() - t0, time.process_time() - c0
    live = scheduler.requests  # request id -> Request, while unfinished
    steps = scheduled = decode = 0
    gc.collect()
    gc.disable()
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for req in reqs:
            scheduler.add_request(req)
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule()
            steps += 1
            scheduled += out.total_num_scheduled_tokens
            ids = list(out.num_scheduled_tokens)
            sampled: list[list[int]] = []
            for rid, k in out.num_scheduled_tokens.items():
                r = live[rid]
                decode += k == 1 and r.num_output_tokens > 0  # feeds its last sampled token
                # A partial prefill chunk samples nothing; otherwise one token, a function of
                # (request index, position) only.
                sampled.append(
                    [] if r.is_prefill_chunk else [(int(rid) * 7919 + r.num_tokens * 31) % VOCAB]
                )
            result = ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={rid: i for i, rid in enumerate(ids)},
                sampled_token_ids=sampled,
            )
            scheduler.update_from_output(out, result)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        gc.enable()
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    done = RequestStatus.FINISHED_LENGTH_CAPPED  # stopped by max_tokens, as ignore_eos means
    bad = sum(r.num_output_tokens != MAX_TOKENS or r.status != done for r in reqs)
    preemptions = sum(r.num_preemptions for r in reqs)
    prefill = scheduled - decode
    # Prefill beyond the first admissions' misses (prompt tokens - hits): recomputation after
    # preemption, at most what the re-admissions missed (preempted queries - hits).
    recomputed = prefill - (stats.queries - stats.hits)
    balanced = 0 <= recomputed <= stats.preempted_queries - stats.preempted_hits
    # Each request feeds back all its sampled tokens but the last; a preemption in decode lets
    # the recomputing prefill feed one of them instead.
    balanced &= n * (MAX_TOKENS - 1) - preemptions <= decode <= n * (MAX_TOKENS - 1)
    return {
        "requests": n,
        "requests_per_s": n / wall,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "requests_per_cpu_s": round(n / cpu, 1),
        # Building the Requests (block hashing included), outside wall_s / cpu_s:
        "request_build_wall_s": round(build_wall, 3),
        "request_build_cpu_s": round(build_cpu, 3),
        "requests_per_s_incl_request_build": round(n / (wall + build_wall), 1),
        "steps": steps,
        "prefix_cache_hit_rate": round(stats.hits / max(1, stats.queries), 4),
        "prefix_cache_queries": stats.queries,
        "prefix_cache_hits": stats.hits,
        "preempted_queries": stats.preempted_queries,
        "preempted_hits": stats.preempted_hits,
        "preemptions": preemptions,
        "scheduled_tokens": scheduled,
        "decode_tokens": decode,
        "prefill_tokens_computed": prefill,
        "recomputed_prefill_tokens": recomputed,
        "tokens_balance_ok": balanced,
        "unfinished_or_wrong_length": bad,
        **FIXED,
        **facts,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=1, help="rounds, one JSON line each")
    args = ap.parse_args(argv)
    for k in range(args.repeat):
        log(f"vLLM {vllm.__version__}: simulating {args.requests} requests (round {k + 1}) …")
        p = run_once(args.requests)
        p["round"] = k + 1
        rate = round(p.pop("requests_per_s"), 1)
        log(
            f"  {rate} req/s wall, {p['requests_per_cpu_s']} req/s CPU, {p['steps']} steps, "
            f"hit rate {p['prefix_cache_hit_rate']}, {p['preemptions']} preemptions"
        )
        rec = {"metric": "vllm_sim_requests_per_s", "value": rate, "unit": "requests/s"}
        print(json.dumps({**rec, "params": p}), flush=True)
        if p["unfinished_or_wrong_length"] or not p["tokens_balance_ok"]:
            log("  WARNING: unfinished/short requests or unbalanced token accounting")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
