"""A deterministic stand-in for a model engine, for simulation and tests.

Token t at position p of request r is a pure function of (r, p), so every run of the same
workload generates the same tokens. Drafts (when a step verifies them) are accepted one by one
with probability `accept_rate`, from a generator seeded by (seed, request, position). Recurrent
states are written only at the end of a step, as a GPU engine does: the outcome reports exactly
the saves at T′ (spec §9.7, E6).
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Mapping
from typing import Any

from kvreuse.core import StepPlan


def token_at(request_id: str, position: int, vocab: int = 32000) -> int:
    """A stable pseudo-random token (CRC-32 of "id/position"; Python's hash() is salted)."""
    return zlib.crc32(f"{request_id}/{position}".encode()) % vocab


class FakeEngine:
    def __init__(self, accept_rate: float = 0.7, seed: int = 0, vocab: int = 32000) -> None:
        if not 0.0 <= accept_rate <= 1.0:
            raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate}")
        self.accept_rate = accept_rate
        self.seed = seed
        self.vocab = vocab
        self.num_forward_tokens = 0

    def __call__(self, step: StepPlan, seqs: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
        out: dict[str, tuple[Any, ...]] = {}
        for plan in step.requests:
            rid = plan.request_id
            num = seqs[rid].num_tokens
            end = plan.start + plan.num_new_tokens
            self.num_forward_tokens += plan.num_new_tokens
            if end < num:  # a prefill chunk: no token is sampled
                t_new, new = end, []
            elif end == num:
                t_new, new = num, [token_at(rid, num, self.vocab)]
            else:  # decode with drafts: accept a prefix of them, then sample one more
                rng = random.Random(f"{self.seed}/{rid}/{num}")
                accepted = 0
                while accepted < end - num and rng.random() < self.accept_rate:
                    accepted += 1
                t_new = num + accepted
                new = [token_at(rid, p, self.vocab) for p in range(num, t_new + 1)]
            saved = [s.position for s in plan.saves if s.position == t_new] if plan.saves else []
            out[rid] = (t_new, new, saved)
        return out
