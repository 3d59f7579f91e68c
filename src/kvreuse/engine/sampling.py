"""Sampling parameters and the sampler.

Each request draws from its own `torch.Generator`, seeded from `SamplingParams.seed`, and draws
exactly one uniform per emitted token. Verifying drafts samples the target at each draft
position in turn and stops at the first mismatch, so a request emits the same tokens, from the
same generator draws, with or without speculation (and with or without a cache hit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """Defaults are vLLM's: 16 tokens, sampled at temperature 1.0 (pass temperature=0 for
    greedy decoding). Without a `seed`, a request's draws are seeded from the engine's seed and
    the request id, so a rerun of the same `LLM` calls gives the same tokens."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be ≥ 1, got {self.max_tokens}")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number ≥ 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int ≥ 0 (0: off), got {self.top_k!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        try:
            stops = tuple(self.stop_token_ids)
        except TypeError:
            stops = (-1,)  # not a sequence: reported below
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be ints ≥ 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)


GREEDY = SamplingParams(temperature=0.0)  # what a request without SamplingParams decodes with


def sample(logits: Tensor, params: SamplingParams, gen: torch.Generator) -> int:
    """One token from a row of logits: greedy at temperature 0, else top-k / top-p sampling."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    scaled = logits.to(torch.float64) / params.temperature
    if 0 < params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p  # smallest set reaching top_p
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, 0.0)
        probs = probs / probs.sum()
    cdf = torch.cumsum(probs, 0)
    u = torch.rand((), generator=gen, dtype=torch.float64) * cdf[-1]
    return int(torch.searchsorted(cdf, u.reshape(1), right=True).clamp(max=probs.numel() - 1))
