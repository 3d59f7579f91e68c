"""The reference for tests/sim/test_vllm_engine.py: vLLM's own Scheduler driven directly, one
request at a time, each run to completion before the next is added. Run by the interpreter of
the venv benchmarks/vllm/setup_venv.sh builds; it imports vLLM and nothing of kvreuse.

stdin: {"geometry": {...}, "requests": [[id, [tokens...], max_tokens], ...]}, the geometry as
plain numbers (see `GEOMETRIES` in the test). stdout: {id: cached tokens}, where a request's
cached tokens are its computed tokens when vLLM first scheduled it, less what that step
scheduled (the prefix vLLM's cache gave it).
"""

from __future__ import annotations

import json
import os
import sys
import types
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

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
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager


def scheduler(g: dict[str, Any]) -> tuple[Scheduler, Any]:
    half = torch.float16
    specs: list[Any] = [
        FullAttentionSpec(block_size=g["attention_block"], num_kv_heads=1, head_size=64, dtype=half)
    ]
    cache = CacheConfig(block_size=g["attention_block"], enable_prefix_caching=True)
    if g.get("mamba_block"):
        specs.append(
            MambaSpec(
                block_size=g["mamba_block"],
                shapes=((1,),),
                dtypes=(half,),
                mamba_cache_mode="align",
                num_prefill_checkpoint_blocks=1,
                prefill_checkpoint_alignment=1,
            )
        )
        cache.mamba_cache_mode, cache.mamba_block_size = "align", g["mamba_block"]
        cache.prefix_match_unit = g["hash_unit"]
    dcp = g.get("dcp", 1)
    sched_cfg = SchedulerConfig(
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=g["max_model_len"],
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    config = VllmConfig(
        scheduler_config=sched_cfg,
        cache_config=cache,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=dcp, decode_context_parallel_size=dcp),
    )
    config.model_config = types.SimpleNamespace(
        max_model_len=g["max_model_len"], runner_type="generate", uses_mrope=False,
        is_encoder_decoder=False, is_diffusion=False, supports_multimodal_inputs=False,
        multimodal_config=None, return_sampling_mask=False, skip_tokenizer_init=True,
        get_vocab_size=lambda: 32000,
    )  # fmt: skip
    cache.num_gpu_blocks = g["num_blocks"]
    groups = [KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)]
    kv = KVCacheConfig(
        num_blocks=g["num_blocks"],
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        # as vLLM's engine core resolves it (the field's own default, None, keeps every state)
        prefix_cache_retention_interval=cache.prefix_cache_retention_interval,
    )
    block, hash_block = resolve_kv_cache_block_sizes(kv, config)
    kv.hash_block_size = hash_block
    kv.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kv, config, block, hash_block
    )
    s = Scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block,
        hash_block_size=hash_block,
    )
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return s, get_request_block_hasher(hash_block, fn, 0)


def main() -> None:
    job = json.load(sys.stdin)
    sched, hasher = scheduler(job["geometry"])
    cached: dict[str, int] = {}
    for rid, tokens, max_tokens in job["requests"]:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        req = Request(rid, tokens, params, None, block_hasher=hasher)
        sched.add_request(req)
        while sched.has_unfinished_requests():
            out = sched.schedule()
            k = out.num_scheduled_tokens.get(rid, 0)
            if rid not in cached and k:
                cached[rid] = req.num_computed_tokens - k
            done = req.num_computed_tokens >= req.num_tokens
            sampled = [[7] if done else []] if k else []
            ids = [rid] if k else []
            result = ModelRunnerOutput(
                req_ids=ids, req_id_to_index={r: 0 for r in ids}, sampled_token_ids=sampled
            )
            sched.update_from_output(out, result)
    json.dump(cached, sys.stdout)


if __name__ == "__main__":
    main()
