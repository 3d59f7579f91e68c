"""The engine moves the bytes of the memory tiers as the core plans them: a prompt whose pages
and states were evicted to the host, to the store or to both comes back with the same tokens
and logits as a cold run, and a corrupted stored block is refused, never used."""

from __future__ import annotations

import random

import pytest
import torch

from kvreuse.core import Admission, TierSpec
from kvreuse.engine import LLM, SamplingParams
from kvreuse.engine.tiers import BytesTier, HostTier, TierCorruption

NEVER = Admission.NEVER
SP = SamplingParams(temperature=0.0, max_tokens=6)
RNG = random.Random(3)
PROMPT = [RNG.randrange(256) for _ in range(150)]
FLOODS = [[RNG.randrange(256) for _ in range(150)] for _ in range(3)]  # evict PROMPT's blocks
POOLS = {"tiny-hybrid-dcp4": 12, "tiny-sliding-hybrid": 24, "tiny-spec-drop": 24}


def tiers(where: str) -> list[tuple[TierSpec, HostTier | BytesTier]]:
    if where == "host":
        return [(TierSpec("host", 400), HostTier())]
    if where == "store":  # the host admits nothing: every block goes on to the store
        return [
            (TierSpec("host", 400, default=NEVER), HostTier()),
            (TierSpec("store", 400), BytesTier()),
        ]
    # pages to the host, recurrent states to the store
    host = TierSpec("host", 400, {"recurrent": NEVER})
    return [(host, HostTier()), (TierSpec("store", 400), BytesTier())]


def generate(llm: LLM, prompt: list[int]) -> tuple[list[int], torch.Tensor, int]:
    llm.runner.record_logits = True
    res = llm.generate([prompt], SP)[0]
    logits = torch.stack(llm.runner.logits_log[res.request_id][: len(res.token_ids)])
    llm.mgr.check_invariants()
    return res.token_ids, logits, res.cached_tokens


@pytest.mark.parametrize("geometry", sorted(POOLS))
@pytest.mark.parametrize("where", ["host", "store", "mixed"])
def test_warm_from_the_tiers_equals_cold(geometry: str, where: str) -> None:
    cold_tokens, cold_logits, _ = generate(LLM(geometry=geometry, enable_caching=False), PROMPT)
    llm = LLM(geometry=geometry, num_blocks=POOLS[geometry], tiers=tiers(where))
    generate(llm, PROMPT)
    for flood in FLOODS:
        generate(llm, flood)
    stack = llm.mgr.tiers
    before = [sum(row) for row in stack.num_loaded]
    tokens, logits, cached = generate(llm, PROMPT)
    loaded = [sum(row) - b for row, b in zip(stack.num_loaded, before, strict=True)]
    assert cached == llm.mgr.replay_point(len(PROMPT)) > 0  # the whole replay hit, loaded back
    assert tokens == cold_tokens
    assert torch.allclose(logits, cold_logits, atol=1e-4)
    if where == "host":
        assert loaded[0] > 0 and stack.hit_tokens == [cached]
    elif where == "store":
        assert loaded == [0, loaded[1]] and loaded[1] > 0 and stack.hit_tokens == [0, cached]
    else:  # pages from the host, states from the store
        assert loaded[0] > 0 and loaded[1] > 0 and stack.hit_tokens[0] == cached


def test_a_corrupted_stored_block_is_refused_not_used() -> None:
    geometry = "tiny-hybrid-dcp4"
    store: dict[str, bytes] = {}
    held = [
        (TierSpec("host", 400, default=NEVER), HostTier()),
        (TierSpec("store", 400), BytesTier(store)),
    ]
    llm = LLM(geometry=geometry, num_blocks=POOLS[geometry], tiers=held)
    generate(llm, PROMPT)
    for flood in FLOODS:
        generate(llm, flood)
    for key, value in list(store.items()):  # one flipped byte in every stored block
        store[key] = value[:-1] + bytes([value[-1] ^ 0xFF])
    with pytest.raises(TierCorruption, match="fail their checksum"):
        llm.generate([PROMPT], SP)
