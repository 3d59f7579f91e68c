"""What a tier below the pool is (`TierSpec`, its `Admission` per group kind) and the ops the
core hands the engine to move bytes between the device and the tiers (`Demote`, `Move`,
`Load`); kvreuse.core.tiers decides them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from kvreuse.core.errors import ConfigError

DEVICE_MEDIUM = "GPU"  # what the device pool's events say (vLLM's value)


class Admission(StrEnum):
    ON_EVICTION = "on_eviction"  # a keyed block the level above evicts is copied here
    WRITE_THROUGH = "write_through"  # copied here when published, and on eviction if missing
    NEVER = "never"  # the kind's blocks skip this tier


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier: a name (metrics and reports show it), its capacity in blocks of the pool's
    size, what it admits per group kind (kinds not named take `default`), and the `medium` its
    KV events name (vLLM's field; the name in capitals unless given: vLLM's own offloading
    connector says "CPU" for host memory, the device is "GPU")."""

    name: str
    num_blocks: int
    admission: Mapping[str, Admission] = field(default_factory=dict)
    default: Admission = Admission.ON_EVICTION
    medium: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(
                f"a tier needs a name (got {self.name!r}); e.g. TierSpec('host', 4096)"
            )
        n = self.num_blocks
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"tier {self.name!r}: num_blocks must be an integer ≥ 1 (got {n!r})")
        for kind, rule in self.admission.items():
            if not isinstance(rule, Admission):
                allowed = ", ".join(a.value for a in Admission)
                raise ConfigError(
                    f"tier {self.name!r}: admission of {kind!r} is {rule!r}; allowed: {allowed}"
                )
        if not self.medium:
            object.__setattr__(self, "medium", self.name.upper())
        if not isinstance(self.medium, str) or self.medium.upper() == DEVICE_MEDIUM:
            raise ConfigError(
                f"tier {self.name!r}: medium {self.medium!r} is not allowed: {DEVICE_MEDIUM!r} "
                "names the device pool itself; e.g. 'CPU' for host memory"
            )

    def admits(self, kind: str) -> bool:
        return self.admission.get(kind, self.default) is not Admission.NEVER

    def writes_through(self, kind: str) -> bool:
        return self.admission.get(kind, self.default) is Admission.WRITE_THROUGH

    def any_write_through(self) -> bool:
        rules = (*self.admission.values(), self.default)
        return Admission.WRITE_THROUGH in rules


# ------------------------------------------------------------------------------ the ops
# Each op also carries `keys`: the (boundary, key) pairs of the bytes it copies, as the core
# knew them when it decided the op. They are the bytes' identity: an engine that keeps a slot
# where others can write (a shared store) stores them beside the bytes and refuses a read
# whose stored identity is not the op's. They take no part in an op's equality.


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


class TierEvents(Protocol):
    """Where a tier's index changes go (the manager's `EventLog`)."""

    enabled: bool

    def tier_stored(self, tier: int, medium: str, group_id: int, keys: Keys) -> None: ...

    def tier_removed(self, tier: int, medium: str, group_id: int, keys: Keys) -> None: ...
