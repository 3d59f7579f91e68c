"""The ghost record (spec §11.3): a bounded FIFO of evicted keys, used only for reason codes.

Keys are kept per group, keyed by the chain hash itself, so the hot paths (every eviction adds
a key, every publication removes one) allocate no tuple. Each value packs an insertion sequence
number and the boundary into one int; with several groups the oldest key overall is the group
head with the smallest sequence number.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

GHOST_SHIFT = 32  # value = seq << 32 | boundary (boundaries stay below 2³¹)
_MASK = (1 << GHOST_SHIFT) - 1


class GhostRecord:
    __slots__ = ("by_group", "capacity", "seq", "size")

    def __init__(self, num_groups: int, capacity: int) -> None:
        self.by_group: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(num_groups)]
        self.capacity = capacity
        self.size = 0
        self.seq = 0

    def __len__(self) -> int:
        return self.size

    def __bool__(self) -> bool:
        return self.size > 0

    def __contains__(self, item: object) -> bool:
        g, key = item  # type: ignore[misc]
        return key in self.by_group[g]

    def add(self, group_id: int, key: bytes, boundary: int) -> None:
        if not self.capacity:
            return
        self.seq += 1
        self.by_group[group_id][key] = self.seq << GHOST_SHIFT | boundary
        self.size += 1
        if self.size > self.capacity:
            self.trim()

    def discard(self, group_id: int, key: bytes) -> None:
        """A key leaves the record when it is published again."""
        if self.by_group[group_id].pop(key, None) is not None:
            self.size -= 1

    def trim(self) -> None:
        """Drop the oldest keys until the record fits its capacity."""
        groups = self.by_group
        while self.size > self.capacity:
            if len(groups) == 1:
                groups[0].popitem(last=False)
            else:
                oldest = min((next(iter(d.values())), g) for g, d in enumerate(groups) if d)[1]
                groups[oldest].popitem(last=False)
            self.size -= 1

    def clear(self) -> None:
        for d in self.by_group:
            d.clear()
        self.size = 0

    def entries(self) -> list[tuple[int, int, bytes]]:
        """(group_id, boundary, hash), oldest first."""
        rows = [(v, g, k) for g, d in enumerate(self.by_group) for k, v in d.items()]
        rows.sort()
        return [(g, v & _MASK, k) for v, g, k in rows]

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return iter([(g, k) for g, _, k in self.entries()])
