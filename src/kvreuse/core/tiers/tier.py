"""One tier: its slots (each a copy of one device block's bytes with every key that block
carried), its index per group (key → slot, in the pool's shape, so the lookup rules read a tier
as they read the pool) and its LRU order; and where its index changes go (`TierEvents`)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from kvreuse.core.errors import InvariantError
from kvreuse.core.tiers.ops import Keys
from kvreuse.core.tiers.spec import TierSpec


class TierEvents(Protocol):
    """Where a tier's index changes go (the manager's `EventLog`)."""

    enabled: bool

    def tier_stored(self, tier: int, medium: str, group_id: int, keys: Keys) -> None: ...

    def tier_removed(self, tier: int, medium: str, group_id: int, keys: Keys) -> None: ...


@dataclass(slots=True)
class Slot:
    group_id: int
    keys: Keys


class Tier:
    """One tier's slots, its per-group index and its LRU order (oldest first)."""

    shared = False  # one object below several stacks (kvreuse.core.tiers.shared)
    log: TierEvents | None = None  # a shared tier's own event log

    def __init__(self, spec: TierSpec, num_groups: int) -> None:
        self.spec = spec
        self.slots: dict[int, Slot] = {}
        self.index: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self.order: OrderedDict[int, None] = OrderedDict()
        self.pinned: set[int] = set()
        self._free = list(range(spec.num_blocks - 1, -1, -1))  # pop() takes slot 0 first
        self.version = 0  # counts changes to the slots (a shared tier's readers compare it)
        self.holder: object | None = None  # a shared tier: the stack whose ops are not taken

    def __len__(self) -> int:
        return len(self.slots)

    def find(self, group_id: int, key: bytes) -> int | None:
        return self.index[group_id].get(key)

    def touch(self, slot: int) -> None:
        self.order.move_to_end(slot)

    def victim(self) -> int | None:
        """The least recently used slot not pinned by a load in progress."""
        for s in self.order:
            if s not in self.pinned:
                return s
        return None

    def take(self, slot: int) -> tuple[Slot, Keys]:
        """Remove a slot and free its number; returns it and the keys that left the index
        (those another slot indexed first stay)."""
        entry = self.slots.pop(slot)
        del self.order[slot]
        self.version += 1
        idx = self.index[entry.group_id]
        gone: Keys = []
        for bd, key in entry.keys:
            if idx.get(key) == slot:
                del idx[key]
                gone.append((bd, key))
        self._free.append(slot)
        return entry, gone

    def place(self, entry: Slot) -> tuple[int, Keys]:
        """Put `entry` in a free slot (the caller made room) as the most recently used; returns
        the slot and the keys it added to the index (one another slot indexes keeps that slot)."""
        slot = self._free.pop()
        self.slots[slot] = entry
        self.version += 1
        self.order[slot] = None
        idx = self.index[entry.group_id]
        new: Keys = []
        for bd, key in entry.keys:
            if key not in idx:
                idx[key] = slot
                new.append((bd, key))
        return slot, new

    def extend(self, slot: int, keys: Keys) -> Keys:
        """Slot `slot` now holds a later copy of the same page, carrying `keys` (its old keys
        and more); returns the keys this added to the index. It becomes the most recent."""
        entry = self.slots[slot]
        entry.keys = list(keys)
        self.version += 1
        self.order.move_to_end(slot)
        idx = self.index[entry.group_id]
        new: Keys = []
        for bd, key in keys:
            if key not in idx:
                idx[key] = slot
                new.append((bd, key))
        return new

    def clear(self) -> None:
        """Forget every slot, in place: views over the index (kvreuse.core.tiers.view) stay
        bound to it."""
        self.slots.clear()
        for idx in self.index:
            idx.clear()
        self.order.clear()
        self.pinned.clear()
        self._free = list(range(self.spec.num_blocks - 1, -1, -1))
        self.version += 1

    def is_full(self) -> bool:
        return not self._free

    def audit(self, where: str) -> None:
        if len(self.slots) > self.spec.num_blocks or len(self.slots) != len(self.order):
            raise InvariantError(f"{where}: {len(self.slots)} slots in {self.spec.num_blocks}")
        if self.pinned:
            raise InvariantError(f"{where}: slots {sorted(self.pinned)} still pinned")
        for gid, idx in enumerate(self.index):
            for key, slot in idx.items():
                entry = self.slots.get(slot)
                if entry is None or entry.group_id != gid or key not in {k for _, k in entry.keys}:
                    raise InvariantError(f"{where}: index of group {gid} names slot {slot} wrongly")
