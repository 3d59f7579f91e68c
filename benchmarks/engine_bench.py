#!/usr/bin/env python3
"""Prefill tokens/s of the PyTorch reference engine, cold vs warm.

On the tiny seeded model (fp32, CPU) and a geometry preset (default `tiny-hybrid-dcp4`): a
4,096-token prompt runs cold (empty cache), then warm as an identical resend and as an extension
(+256 tokens). Each run generates one token, so its wall time is the prefill (time to first
token). `prompt_tokens_per_s` = prompt tokens / wall time: what the user sees; the warm runs
compute only the tokens past the hit. Prints one JSON object per line (`metric`, `value`,
`unit`, `params`); progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from kvreuse.engine import LLM, SamplingParams


def _timed(llm: LLM, prompt: list[int]) -> tuple[float, int, int]:
    before = llm.runner.num_forward_tokens
    t0 = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))[0]
    wall = time.perf_counter() - t0
    return wall, out.cached_tokens, llm.runner.num_forward_tokens - before


def _emit(metric: str, value: float, unit: str, **params: object) -> None:
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit, "params": params}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="JSON lines (the only output format)")
    ap.add_argument("--geometry", default="tiny-hybrid-dcp4")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(args.prompt_tokens)]
    extended = prompt + [rng.randrange(256) for _ in range(256)]
    llm = LLM(geometry=args.geometry)
    if args.threads != 1:
        import torch

        torch.set_num_threads(args.threads)
    other = [(t + 1) % 256 for t in prompt[:64]]  # warm up torch on a prefix nobody shares
    llm.generate([other], SamplingParams(max_tokens=1, temperature=0))
    runs = [("cold", prompt), ("warm_identical", prompt), ("warm_extended", extended)]
    results = {}
    for name, p in runs:
        print(f"{name}: {len(p)} prompt tokens …", file=sys.stderr)
        wall, hit, computed = _timed(llm, p)
        results[name] = wall
        params = {
            "geometry": args.geometry,
            "run": name,
            "prompt_tokens": len(p),
            "cached_tokens": hit,
            "computed_tokens": computed,
            "wall_s": round(wall, 4),
            "threads": args.threads,
        }
        _emit("prefill_prompt_tokens_per_s", len(p) / wall, "tokens/s", **params)
        _emit("prefill_computed_tokens_per_s", computed / wall, "tokens/s", **params)
    _emit(
        "warm_speedup",
        results["cold"] / results["warm_identical"],
        "x",
        geometry=args.geometry,
        prompt_tokens=len(prompt),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
