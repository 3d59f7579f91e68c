"""Run by vLLM 0.33.0's own interpreter (benchmarks/vllm/setup_venv.sh builds it): vLLM's side
of tests/events/test_vllm_hashes.py. It imports nothing from kvreuse.

    python vllm_hash_driver.py < lines

Line 1: {"block_size", "num_blocks"}, answered by {"none_hash"} (hex). Then one line per request,
{"id", "tokens", "lora": [name, path] | null, "mm": [[identifier, offset, length], ...],
"salt": str | null}, answered by {"hit", "hashes" (hex), "events" (plain data)}.
PYTHONHASHSEED in the environment is vLLM's seed, as in a real vLLM process.

One `KVCacheManager` (one full-attention group, sha256_cbor, KV events on) admits each request
the way vLLM's scheduler does for a prompt: lookup, slots for the rest of the prompt (which
caches its full blocks), then free.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

import msgspec
import torch
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request


def manager(block: int, num_blocks: int) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=64, dtype=torch.float16)
    group = KVCacheGroupSpec(layer_names=["layers.0.attn"], kv_cache_spec=spec)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[group])
    return KVCacheManager(
        kv_cache_config=config,
        max_model_len=1 << 16,
        scheduler_block_size=block,
        hash_block_size=block,
        enable_caching=True,
        enable_kv_cache_events=True,
    )


def request(spec: dict, hasher: object) -> Request:
    lora = spec.get("lora")
    mm = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=ident,
            mm_position=PlaceholderRange(offset=off, length=length),
        )
        for ident, off, length in spec.get("mm", [])
    ]
    return Request(
        request_id=spec["id"],
        prompt_token_ids=list(spec["tokens"]),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=mm or None,
        lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
        cache_salt=spec.get("salt"),
        block_hasher=hasher,  # type: ignore[arg-type]
    )


def main() -> None:
    """Line-delimited JSON on stdin and stdout: the first line configures, each later line is
    one request and is answered by one line, so a router can route on what it saw so far."""
    job = json.loads(sys.stdin.readline())
    block = job["block_size"]
    fn = get_hash_fn_by_name("sha256_cbor")
    kv_cache_utils.init_none_hash(fn)  # reads PYTHONHASHSEED, as the engine does
    hasher = kv_cache_utils.get_request_block_hasher(block, fn)
    mgr = manager(block, job["num_blocks"])
    print(json.dumps({"none_hash": kv_cache_utils.NONE_HASH.hex()}), flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        req = request(spec, hasher)
        mgr.new_step_starts()
        blocks, hit, *_ = mgr.get_computed_blocks(req)
        slots = mgr.allocate_slots(req, req.num_prompt_tokens - hit, hit, blocks)
        assert slots is not None, "the pool is too small"
        req.num_computed_tokens = req.num_prompt_tokens
        mgr.take_kv_cache_block_copies()
        mgr.take_new_block_ids()
        mgr.free(req)
        events = [msgspec.to_builtins(e) | {"type": type(e).__name__} for e in mgr.take_events()]
        answer = {"hit": int(hit), "hashes": [h.hex() for h in req.block_hashes], "events": events}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
