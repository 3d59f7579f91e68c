"""The step plan handed to the engine (spec §9.7).

    allocate ─► RequestPlan ─┐
    allocate ─► RequestPlan ─┼─► seal_step() ─► StepPlan(step_id, requests, copies)
    allocate ─► RequestPlan ─┘                  engine: tier ops, copies (E1), the forward

Plans are snapshots: tables are copied when the plan is built, so later growth of the
request never changes a plan the engine already holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvreuse.core.tiers.ops import TierOp


@dataclass(frozen=True, slots=True)
class Copy:
    """Duplicate block `src` into `dst` for every layer of the group, on every rank (E1)."""

    group_id: int
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class Save:
    """Write the recurrent state after exactly `position` tokens into `block` (E3)."""

    group_id: int
    position: int
    block: int


@dataclass(frozen=True, slots=True)
class RecurrentSlot:
    live: int
    scratch: tuple[int, ...]
    init: Literal["zero", "copy", "keep"]


@dataclass(slots=True)
class RequestPlan:
    """One request's share of a step: compute positions [start, start + num_new_tokens).

    Read-only by contract. Not a frozen dataclass, and built positionally on the decode path: one
    is built per request per step, and frozen construction cost 3 µs of a ~15 µs decode step
    (keyword construction 0.25 µs more); the manager keeps its own copy of what it later checks
    (docs/decisions.md, D13).
    """

    request_id: str
    start: int
    num_new_tokens: int
    num_extra_slots: int
    tables: dict[int, list[int]]
    recurrent: dict[int, RecurrentSlot]
    new_blocks: dict[int, list[int]]
    copies: list[Copy]
    saves: list[Save]
    hit: int = 0
    is_admission: bool = False

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Everything the engine needs for one forward. Empty steps need no commit.

    With memory tiers, `tier_ops` (kvreuse.core.tiers.ops: Demote, Move, Load) run first, in their
    order, then the copies, then the forward: each op was decided while the bytes it reads
    were where it names them."""

    step_id: int
    requests: list[RequestPlan] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    tier_ops: list[TierOp] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.requests)
