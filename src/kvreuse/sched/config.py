"""The scheduler's knobs (`SchedulerConfig`), checked when built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Scheduling knobs. `num_spec_tokens` > 0 verifies that many drafts per decode step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_spec_tokens: int = 0
    chunk_at_save_positions: bool = True  # end prefill chunks at the core's save positions
    defer_shared_prefix: bool = True  # wait for a prefix another request is computing
    max_defer_steps: int = 8

    def __post_init__(self) -> None:
        for name, minimum in (
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("num_spec_tokens", 0),
            ("max_defer_steps", 0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
            if not minimum <= value < 2**63:
                raise ValueError(f"{name} must be in [{minimum}, 2**63), got {value}")
        for name in ("chunk_at_save_positions", "defer_shared_prefix"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if 1 + self.num_spec_tokens > self.max_num_batched_tokens:
            # a decode step (one token plus its drafts) would never fit a step's budget
            raise ValueError(
                f"a decode step needs 1 + num_spec_tokens = {1 + self.num_spec_tokens} tokens, "
                f"more than max_num_batched_tokens = {self.max_num_batched_tokens}; lower "
                "num_spec_tokens or raise max_num_batched_tokens"
            )
