"""The ops the core hands the engine to move bytes between the device and the tiers (`Demote`,
`Move`, `Load`); the stack (kvreuse.core.tiers.stack) decides them.

Each op also carries `keys`: the (boundary, key) pairs of the bytes it copies, as the core
knew them when it decided the op. They are the bytes' identity: an engine that keeps a slot
where others can write (a shared store) stores them beside the bytes and refuses a read whose
stored identity is not the op's. They take no part in an op's equality.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Demote:
    """Copy device block `block_id` (group `group_id`) into slot `slot` of tier `tier`."""

    tier: int
    slot: int
    group_id: int
    block_id: int
    keys: tuple[tuple[int, bytes], ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Move:
    """Copy slot `src_slot` of tier `src_tier` into slot `dst_slot` of tier `dst_tier`."""

    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    keys: tuple[tuple[int, bytes], ...] = field(default=(), compare=False, repr=False)
    group_id: int = field(default=-1, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Load:
    """Copy slot `slot` of tier `tier` into device block `block_id` (group `group_id`)."""

    tier: int
    slot: int
    group_id: int
    block_id: int
    keys: tuple[tuple[int, bytes], ...] = field(default=(), compare=False, repr=False)


TierOp = Demote | Move | Load
Keys = list[tuple[int, bytes]]  # (boundary, key), ascending: the keys one block carries
