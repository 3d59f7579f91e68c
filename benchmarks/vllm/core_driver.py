#!/usr/bin/env python3
"""vLLM's side of `core_bench.py --with-anchor`: vLLM's own v1 prefix-cache code on the same
workloads, measured the same way, printed as JSON lines that `benchmarks/anchor.py` reads.

Run it with the interpreter of the venv that `benchmarks/vllm/setup_venv.sh` builds; it imports
vLLM there and drives its `KVCacheManager` directly, the way vLLM's scheduler does for one
full-attention group (no model, no GPU, no worker: the manager only counts blocks).

    .venv-vllm-anchor/bin/python benchmarks/vllm/core_driver.py --quick
    .venv-vllm-anchor/bin/python benchmarks/vllm/core_driver.py --only lookup,cycle --repeat 3

Workloads (token ids `random.Random(seed).randrange(32000)`, the seeds of core_bench.py; one
full-attention group of block 16, which is also vLLM's hash granularity then; sha256):

  hash     one 131,072-token prompt (seed 1): the request block hasher over the whole prompt
  lookup   that prompt's cold life (lookup + allocate_slots + free, once), then
           `get_computed_blocks` of a fully cached copy (seed 2) and of a copy whose first token
           differs; median of 5 x --repeat calls each
  cycle    1,000 requests of 2,048 tokens = a 1,024-token prefix (seed 3) + a suffix
           (seed 1000+i), built (and so hashed) before timing; per request one scheduler step:
           new_step_starts + get_computed_blocks + allocate_slots; freed in waves of 32
  memory   tracemalloc from before the manager exists to after 100 requests of 16,000 tokens
           have each been looked up, allocated and freed, divided by the cached blocks

Output: one JSON object per line, {"bench", "metric", "value", "unit", "params", "impl"}; the
first line (bench "env") records the versions. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

# vLLM logs at INFO to stdout unless told otherwise; stdout carries results only.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")

try:
    import torch
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request
except ImportError as exc:
    sys.exit(
        f"core_driver.py: cannot import vLLM ({exc}); run it with .venv-vllm-anchor/bin/python "
        "(build that venv with: bash benchmarks/vllm/setup_venv.sh)"
    )

BLOCK = 16  # tokens per block = per hash, as kvreuse's `fa-b16` workloads
GEOMETRY = "fa-b16"
BENCHES = ("hash", "lookup", "cycle", "memory")
ALIASES = {"batch": "cycle"}  # the name older drivers used
IMPL = f"vllm-{vllm.__version__}"


@dataclass(frozen=True)
class Sizes:
    hash_tokens: int
    lookup_tokens: int
    cycle_requests: int
    cycle_prompt: int
    cycle_prefix: int
    cycle_wave: int
    cycle_blocks: int
    mem_requests: int
    mem_tokens: int


FULL = Sizes(131_072, 131_072, 1000, 2048, 1024, 32, 16_384, 100, 16_000)
QUICK = Sizes(8192, 8192, 50, 2048, 1024, 16, 4096, 5, 16_000)


class Out:
    """JSON lines on stdout, and appended to --out when given."""

    def __init__(self, path: str | None) -> None:
        self.file: IO[str] | None = open(path, "a") if path else None  # noqa: SIM115

    def emit(self, bench: str, metric: str, value: Any, unit: str, **params: Any) -> None:
        if isinstance(value, float):
            value = round(value, 3)
        rec = {"bench": bench, "metric": metric, "value": value, "unit": unit}
        line = json.dumps({**rec, "params": params, "impl": IMPL})
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def _median_ns(samples: list[int]) -> float:
    return float(statistics.median(samples))


class Core:
    """One vLLM KVCacheManager with a single full-attention group of block 16, and the request
    hasher its engine would attach to every request."""

    def __init__(self, num_blocks: int, max_model_len: int, hash_fn: str = "sha256") -> None:
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16
        )
        group = KVCacheGroupSpec(layer_names=["layers.0.attn"], kv_cache_spec=spec)
        # The manager never touches KV memory, so it gets no tensors.
        config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[group])
        fn = get_hash_fn_by_name(hash_fn)
        init_none_hash(fn)  # the engine sets the chain's seed hash once per process
        self.hasher = get_request_block_hasher(BLOCK, fn)
        # One group without DCP: vLLM schedules and hashes at the block size itself.
        self.manager = KVCacheManager(
            kv_cache_config=config,
            max_model_len=max_model_len,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
            enable_caching=True,
        )

    def request(self, request_id: str, token_ids: list[int], hashed: bool = True) -> Request:
        return Request(
            request_id=request_id,
            prompt_token_ids=list(token_ids),
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
            block_hasher=self.hasher if hashed else None,
        )

    def drain(self) -> None:
        """What the scheduler hands to its workers after every step; drained so those lists do
        not grow (nothing is copied in these workloads: hits are block-aligned)."""
        self.manager.take_kv_cache_block_copies()
        self.manager.take_new_block_ids()

    def admit(self, req: Request) -> int:
        """One step: lookup, then slots for the whole rest of the prompt (which also caches its
        full blocks). Returns the hit."""
        mgr = self.manager
        mgr.new_step_starts()
        blocks, hit, _junction = mgr.get_computed_blocks(req)
        if mgr.allocate_slots(req, req.num_prompt_tokens - hit, hit, blocks) is None:
            raise MemoryError(f"{req.request_id}: the pool is too small")
        req.num_computed_tokens = req.num_prompt_tokens
        self.drain()
        return int(hit)


# ------------------------------------------------------------------------------------ benches
def bench_hash(out: Out, s: Sizes, repeat: int, hash_fns: list[str]) -> None:
    prompt = tokens(s.hash_tokens, seed=1)
    for name in hash_fns:
        try:
            fn = get_hash_fn_by_name(name)
            init_none_hash(fn)
        except Exception as exc:  # an optional hash package missing: say so and go on
            out.emit("hash", "unavailable", str(exc), "", hash_fn=name)
            continue
        hasher = get_request_block_hasher(BLOCK, fn)
        samples: list[int] = []
        num_hashes = 0
        for _ in range(repeat):
            # built without a hasher, so that only the timed call hashes
            req = Request("h", prompt, SamplingParams(max_tokens=1), None)
            gc.collect()
            t0 = time.perf_counter_ns()
            num_hashes = len(hasher(req))
            samples.append(time.perf_counter_ns() - t0)
        med = _median_ns(samples)
        out.emit(
            "hash",
            "tokens_per_s",
            round(s.hash_tokens / (med / 1e9)),
            "tokens/s",
            hash_fn=name,
            block_size=BLOCK,
            num_tokens=s.hash_tokens,
            num_hashes=num_hashes,
            median_ms=round(med / 1e6, 3),
            min_ms=round(min(samples) / 1e6, 6),
            repeat=repeat,
            stat=f"median of {repeat}",
        )
        log(f"hash {name}: {s.hash_tokens / med * 1e3:.2f} M tokens/s (median of {repeat})")
    init_none_hash(get_hash_fn_by_name("sha256"))


def bench_lookup(out: Out, s: Sizes, repeat: int) -> None:
    n = s.lookup_tokens
    num_blocks = n // BLOCK + 256
    core = Core(num_blocks, max_model_len=n + 1024)
    prompt = tokens(n, seed=2)
    cold = core.request("cold", prompt)  # hashed here, outside the timer
    gc.collect()
    t0 = time.perf_counter_ns()
    core.admit(cold)
    core.manager.free(cold)
    cold_ns = time.perf_counter_ns() - t0
    common = dict(geometry=GEOMETRY, num_tokens=n, block_size=BLOCK, num_blocks=num_blocks)
    out.emit(
        "lookup",
        "cold_request_lookup_prefill_free_ms",
        cold_ns / 1e6,
        "ms",
        **common,
        timed="new_step_starts + get_computed_blocks + allocate_slots (caches every block) + free",
    )
    for label, toks in (("full_hit", prompt), ("miss", [prompt[0] + 1, *prompt[1:]])):
        req = core.request(label, toks)
        samples: list[int] = []
        hit = -1
        gc.collect()
        for _ in range(repeat):
            t0 = time.perf_counter_ns()
            _blocks, hit, _junction = core.manager.get_computed_blocks(req)
            samples.append(time.perf_counter_ns() - t0)
        med = _median_ns(samples)
        ordered = sorted(samples)
        out.emit(
            "lookup",
            f"get_computed_blocks_{label}_us",
            med / 1e3,
            "us",
            **common,
            hit_tokens=hit,
            num_hashes=len(req.block_hashes),
            min_us=round(ordered[0] / 1e3, 3),
            p90_us=round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] / 1e3, 3),
            repeat=repeat,
            stat=f"median of {repeat}",
        )
        log(f"lookup {label}: median {med / 1e3:.1f} us (hit {hit} tokens)")


def bench_cycle(out: Out, s: Sizes) -> None:
    core = Core(s.cycle_blocks, max_model_len=s.cycle_prompt + 1024)
    prefix = tokens(s.cycle_prefix, seed=3)
    t0 = time.perf_counter_ns()
    reqs = [
        core.request(f"req-{i}", prefix + tokens(s.cycle_prompt - s.cycle_prefix, seed=1000 + i))
        for i in range(s.cycle_requests)
    ]
    t_build = time.perf_counter_ns() - t0
    mgr, pc = core.manager, time.perf_counter_ns
    t_lookup = t_alloc = t_free = 0
    total_hit = 0
    live: list[Request] = []
    gc.collect()
    for i, req in enumerate(reqs):
        t0 = pc()
        mgr.new_step_starts()
        blocks, hit, _junction = mgr.get_computed_blocks(req)
        t1 = pc()
        slots = mgr.allocate_slots(req, req.num_prompt_tokens - hit, hit, blocks)
        t2 = pc()
        if slots is None:
            raise MemoryError("cycle: the pool is too small for a wave")
        req.num_computed_tokens = req.num_prompt_tokens
        core.drain()
        t_lookup += t1 - t0
        t_alloc += t2 - t1
        total_hit += hit
        live.append(req)
        if len(live) == s.cycle_wave or i == len(reqs) - 1:
            t3 = pc()
            for r in live:
                mgr.free(r)
            t_free += pc() - t3
            live.clear()
    n = len(reqs)
    params = dict(
        num_requests=n,
        prompt_len=s.cycle_prompt,
        prefix_len=s.cycle_prefix,
        wave=s.cycle_wave,
        block_size=BLOCK,
        num_blocks=s.cycle_blocks,
        hash_fn="sha256",
    )
    parts = (
        ("build_request_us_per_request", t_build),
        ("lookup_us_per_request", t_lookup),
        ("allocate_slots_us_per_request", t_alloc),
        ("free_us_per_request", t_free),
        ("lookup_alloc_free_us_per_request", t_lookup + t_alloc + t_free),
    )
    for metric, ns in parts:
        out.emit("cycle", metric, ns / n / 1e3, "us", **params)
    out.emit("cycle", "mean_hit_tokens", total_hit / n, "tokens", **params)
    log(
        f"cycle: lookup {t_lookup / n / 1e3:.1f} + allocate {t_alloc / n / 1e3:.1f} + free "
        f"{t_free / n / 1e3:.1f} us per request; mean hit {total_hit / n:.0f}"
    )


def bench_memory(out: Out, s: Sizes) -> None:
    blocks_per_request = s.mem_tokens // BLOCK
    num_blocks = s.mem_requests * blocks_per_request + 1 + 64
    # The prompts exist before the window opens: it measures the cache, not the inputs.
    prompts = [tokens(s.mem_tokens, seed=50_000 + i) for i in range(s.mem_requests)]
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    core = Core(num_blocks, max_model_len=s.mem_tokens + 1024)
    gc.collect()
    after_pool, _ = tracemalloc.get_traced_memory()
    for i, prompt in enumerate(prompts):
        req = core.request(f"m{i}", prompt)
        core.admit(req)
        core.manager.free(req)
        del req
    gc.collect()
    after_cache, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    cached = len(core.manager.block_pool.cached_block_hash_to_block)
    params = dict(
        num_pool_blocks=num_blocks,
        num_cached_blocks=cached,
        block_size=BLOCK,
        hash_fn="sha256",
        requests=s.mem_requests,
        blocks_per_request=blocks_per_request,
    )
    per = max(1, cached)
    out.emit("memory", "pool_bytes_per_block", (after_pool - base) / num_blocks, "bytes", **params)
    out.emit(
        "memory",
        "cache_index_bytes_per_cached_block",
        (after_cache - after_pool) / per,
        "bytes",
        **params,
    )
    out.emit(
        "memory",
        "resident_bytes_per_cached_block",
        (after_cache - base) / per,
        "bytes",
        **params,
        window="from before the manager is built to after the last free, / cached blocks",
    )
    out.emit("memory", "peak_bytes_per_cached_block", (peak - base) / per, "bytes", **params)
    log(f"memory: {(after_cache - base) / per:.0f} bytes per cached block ({cached} blocks)")
    del prompts


# ------------------------------------------------------------------------------------ main
def parse_only(text: str) -> list[str]:
    names = {ALIASES.get(x.strip(), x.strip()) for x in text.split(",") if x.strip()}
    unknown = sorted(names - set(BENCHES))
    if unknown:
        sys.exit(f"core_driver.py: --only: unknown {', '.join(unknown)}; choose from {BENCHES}")
    return [b for b in BENCHES if b in names]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--only", default=",".join(BENCHES), help="comma list of " + ",".join(BENCHES))
    ap.add_argument("--out", help="also append the JSON lines to this file")
    ap.add_argument("--quick", action="store_true", help="small sizes (core_bench.py --quick)")
    ap.add_argument("--repeat", type=int, default=None, help="hash runs; lookups run 5x this")
    ap.add_argument("--hash-fns", default="sha256", help="vLLM hash options to time")
    args = ap.parse_args(argv)
    which = parse_only(args.only)
    repeat = args.repeat if args.repeat is not None else (3 if args.quick else 7)
    if repeat < 1:
        ap.error(f"--repeat must be at least 1, got {repeat}")
    s = QUICK if args.quick else FULL
    out = Out(args.out)
    versions = {"vllm": vllm.__version__, "torch": torch.__version__}
    out.emit(
        "env",
        "versions",
        {**versions, "python": platform.python_version()},
        "",
        cpus=os.cpu_count(),
        machine=platform.machine(),
        loadavg=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        quick=args.quick,
        only=which,
    )
    jobs: dict[str, Callable[[], None]] = {
        "hash": lambda: bench_hash(out, s, repeat, args.hash_fns.split(",")),
        "lookup": lambda: bench_lookup(out, s, repeat * 5),
        "cycle": lambda: bench_cycle(out, s),
        "memory": lambda: bench_memory(out, s),
    }
    try:
        for name in which:
            jobs[name]()
    finally:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
