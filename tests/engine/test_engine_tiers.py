"""The engine moves the bytes of the memory tiers as the core plans them: a prompt whose pages
and states were evicted to the host, to the store or to both comes back with the same tokens
and logits as a cold run; a stored block that is absent, altered or another block's is a miss:
the request computes its prefix again and answers as a cold run does."""

from __future__ import annotations

import random

import pytest
import torch

from kvreuse.core import Admission, TierSpec
from kvreuse.engine import LLM, SamplingParams
from kvreuse.engine.tiers import MAGIC, BytesTier, HostTier

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


def _tamper(store: dict[str, bytes], how: str) -> None:
    """Spoil every stored block as a faulty or hostile store would."""
    keys = sorted(store)
    values = [store[k] for k in keys]
    for i, key in enumerate(keys):
        value = values[i]
        if how == "flipped":
            store[key] = value[:-40] + bytes([value[-40] ^ 0x01]) + value[-39:]
        elif how == "truncated":
            store[key] = value[: len(value) // 2]
        elif how == "absent":
            del store[key]
        elif how == "swapped":  # a valid block of another slot, tag and all
            store[key] = values[(i + 1) % len(values)]
        elif how == "re-tagged":  # an edited payload under a tag computed without the key
            import hashlib
            import hmac

            body = value[:-32][:-40] + bytes([value[:-32][-40] ^ 0x01]) + value[:-32][-39:]
            store[key] = body + hmac.digest(hashlib.sha256(b"").digest(), body, "sha256")
        assert how == "absent" or store[key][:4] == MAGIC or how == "truncated"


@pytest.mark.parametrize("how", ["flipped", "truncated", "absent", "swapped", "re-tagged"])
def test_a_bad_stored_block_is_a_miss_never_used(how: str) -> None:
    """Every stored block spoiled: the resend loads none of them, computes its prefix again
    and answers with the cold run's tokens and logits, twice (nothing wrong reached the device
    cache); each spoiled block that was read is counted and forgotten by the store tier."""
    geometry = "tiny-hybrid-dcp4"
    cold_tokens, cold_logits, _ = generate(LLM(geometry=geometry, enable_caching=False), PROMPT)
    store: dict[str, bytes] = {}
    held = [
        (TierSpec("host", 400, default=NEVER), HostTier()),
        (TierSpec("store", 400), BytesTier(store)),
    ]
    llm = LLM(geometry=geometry, num_blocks=POOLS[geometry], tiers=held)
    generate(llm, PROMPT)
    for flood in FLOODS:
        generate(llm, flood)
    assert store
    _tamper(store, how)
    hits = llm.mgr.metrics()["prefix_cache_hits"]
    tokens, logits, cached = generate(llm, PROMPT)
    assert tokens == cold_tokens
    assert torch.allclose(logits, cold_logits, atol=1e-4)
    tiers_now = llm.mgr.metrics()["tiers"]["store"]
    assert llm.runner.num_tier_misses > 0 and tiers_now["faulty_blocks"] > 0
    assert tiers_now["hit_tokens"] == 0  # no hit the store never delivered is counted
    assert llm.mgr.metrics()["prefix_cache_hits"] - hits == cached  # the hit it delivered
    again, logits2, _ = generate(llm, PROMPT)  # from its own cache now: still the cold answer
    assert again == cold_tokens and torch.allclose(logits2, cold_logits, atol=1e-4)
