"""How closely the engine's Hugging Face families agree with `transformers`' forward.

    .venv/bin/python benchmarks/hf_agreement.py          # one JSON line per family and DCP size

For each family it builds the tests' tiny checkpoint (tests/engine/hf_tiny.py, seed as in the
tests), runs a 70-token prompt and 6 greedy tokens through `LLM(model=DIR)` with caching off on
DCP 1, 2 and 4, and prints the largest |Δlogit| against `transformers`' `model(ids).logits` at
the sampled positions (`paged`), over every position through the dense context (`dense`, DCP
1 only), the logits' largest magnitude, and, for Qwen3-Next, how far `transformers`' own
token-by-token decode strays from its own full forward over the decoded positions (`hf_self`).
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))

from hf_tiny import build, hf_logits

from kvreuse.deployment import load_geometry
from kvreuse.engine import LLM, SamplingParams
from kvreuse.hfconfig import GeometryOptions, model_geometry

FAMILIES = ["granite", "gemma3", "lfm2", "qwen3_next"]


def _hf_decode_drift(ref: object, tokens: list[int], start: int) -> float:
    """transformers' cached token-by-token logits against its own full forward."""
    full = hf_logits(ref, tokens)
    with torch.no_grad():
        out = ref(torch.tensor([tokens[:start]]), use_cache=True)  # type: ignore[operator]
        rows, cache = [out.logits[0, -1]], out.past_key_values
        for t in tokens[start:]:
            out = ref(torch.tensor([[t]]), past_key_values=cache, use_cache=True)  # type: ignore[operator]
            rows.append(out.logits[0, -1])
            cache = out.past_key_values
    return float((torch.stack(rows[:-1]) - full[start - 1 : -1]).abs().max())


def main() -> None:
    rng = random.Random(11)
    prompt = [rng.randrange(256) for _ in range(70)]
    sp = SamplingParams(temperature=0.0, max_tokens=6)
    with tempfile.TemporaryDirectory() as tmp:
        for seed, family in enumerate(FAMILIES):
            directory = Path(tmp) / family
            ref = build(family, directory, seed=seed)
            for dcp in (1, 2, 4):
                opts = GeometryOptions(
                    dcp_size=dcp, block_size=4, capacity_tokens=4096, max_num_batched_tokens=32
                )
                dep = load_geometry(model_geometry(directory, opts), family)
                llm = LLM(model=str(directory), geometry=dep, enable_caching=False)
                llm.runner.record_logits = True
                res = llm.generate([prompt], sp)[0]
                full = prompt + res.token_ids[:-1]
                want = hf_logits(ref, full)
                got = torch.stack(llm.runner.logits_log[res.request_id])
                row = {
                    "family": family,
                    "dcp": dcp,
                    "paged": float((got - want[len(prompt) - 1 :]).abs().max()),
                    "max_abs_logit": float(want.abs().max()),
                }
                if dcp == 1:
                    row["dense"] = float((llm.model.dense_logits(full) - want).abs().max())
                    if family == "qwen3_next":
                        row["hf_self"] = _hf_decode_drift(ref, full, 40)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
