"""The ghost record (spec §11.3): a bounded FIFO of evicted keys, used only for reason codes.

Keys are kept per group, keyed by the chain hash itself, so the hot paths (every eviction adds
a key, every publication removes one) allocate no tuple. Each value packs an insertion sequence
number and the boundary into one int; with several groups the oldest key overall is the group
head with the smallest sequence number. The record is changed only through its methods, which
keep the size and the sequence number consistent with the per-group dicts.

`GhostRecord` is the reference. On the native path (`kvreuse.core.native`) the pool holds the
C type `Ghost` instead (_csrc/ghost.c: one FIFO ring over all groups and a hash table of its
keys, no Python object per key), with the same interface and observable behaviour; `new_ghost`
picks one when the pool is constructed, and tests/core/test_native_ghost.py compares the two.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter
from typing import Protocol

from kvreuse.core import native

_SHIFT = 32  # value = seq << 32 | boundary (boundaries stay below 2³¹)
_MASK = (1 << _SHIFT) - 1


class Ghost(Protocol):
    """What the pool, the lookup and the views use of a ghost record (both implementations)."""

    @property
    def capacity(self) -> int: ...
    def __len__(self) -> int: ...
    def __contains__(self, item: object) -> bool: ...
    def __iter__(self) -> Iterator[tuple[int, bytes]]: ...
    def contains(self, group_id: int, key: bytes) -> bool: ...
    def add(self, group_id: int, key: bytes, boundary: int) -> None: ...
    def add_many(self, evicted: Iterable[tuple[int, bytes, int]]) -> None: ...
    def discard(self, group_id: int, key: bytes) -> None: ...
    def discard_many(self, group_id: int, keys: Sequence[bytes]) -> None: ...
    def clear(self) -> None: ...
    def entries(self) -> list[tuple[int, int, bytes]]: ...


def new_ghost(num_groups: int, capacity: int) -> Ghost:
    """The C `Ghost` where the native kernels are active (read now: tests switch `native.ext`
    before constructing), else the pure `GhostRecord`."""
    ext = native.ext
    if ext is None:
        return GhostRecord(num_groups, capacity)
    ghost: Ghost = ext.Ghost(num_groups, capacity)
    return ghost


class GhostRecord:
    """Evicted (group, key) pairs with their boundary, oldest first, at most `capacity`."""

    __slots__ = ("_by_group", "_capacity", "_seq", "_size")

    def __init__(self, num_groups: int, capacity: int) -> None:
        self._by_group: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(num_groups)]
        self._capacity = capacity
        self._size = 0
        self._seq = 0

    @property
    def capacity(self) -> int:
        return self._capacity

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __contains__(self, item: object) -> bool:
        """`(group_id, key) in ghost`."""
        if not isinstance(item, tuple) or len(item) != 2:
            return False
        return item[1] in self._by_group[item[0]]

    def contains(self, group_id: int, key: bytes) -> bool:
        return key in self._by_group[group_id]

    def add(self, group_id: int, key: bytes, boundary: int) -> None:
        """Remember one evicted key."""
        self.add_many(((group_id, key, boundary),))

    def add_many(self, evicted: Iterable[tuple[int, bytes, int]]) -> None:
        """Remember evicted (group_id, key, boundary) triples, oldest first; trim once.

        Trimming after the batch keeps the same keys as trimming after each add: the record
        keeps the newest `capacity` keys either way. An evicted key is never in the record
        (publishing it removed it), so each triple normally adds one key; a key added again
        (by a caller other than the pool) becomes the newest, counted once.
        """
        if not self._capacity:
            return
        groups = self._by_group
        seq = self._seq
        start = seq
        if len(groups) == 1:  # the common model: one group, one dict
            d = groups[0]
            for _, key, boundary in evicted:
                seq += 1
                d[key] = seq << _SHIFT | boundary
        else:
            for gid, key, boundary in evicted:
                seq += 1
                groups[gid][key] = seq << _SHIFT | boundary
        self._seq = seq
        size = len(groups[0]) if len(groups) == 1 else sum(map(len, groups))
        if size != self._size + seq - start:  # a key added again kept its old dict position
            self._reorder()
        self._size = size
        if self._size > self._capacity:
            self._trim()

    def discard(self, group_id: int, key: bytes) -> None:
        """A key leaves the record when it is published again."""
        if self._size and self._by_group[group_id].pop(key, None) is not None:
            self._size -= 1

    def discard_many(self, group_id: int, keys: Sequence[bytes]) -> None:
        """`discard` of each key: a publication removes the keys it made resident again."""
        d = self._by_group[group_id]
        if not d:
            return
        if len(keys) < 8:  # a decode step's publication: cheaper than building a set
            gone = [key for key in keys if d.pop(key, None) is not None]
        else:  # a prefill's: one C-level intersection
            gone = list(d.keys() & set(keys))
            for key in gone:
                del d[key]
        self._size -= len(gone)

    def _reorder(self) -> None:
        """Put each group's keys back in sequence order (the rare re-add of a present key)."""
        for d in self._by_group:
            items = sorted(d.items(), key=itemgetter(1))
            d.clear()
            d.update(items)

    def _trim(self) -> None:
        """Drop the oldest keys until the record fits its capacity."""
        groups = self._by_group
        while self._size > self._capacity:
            if len(groups) == 1:
                groups[0].popitem(last=False)
            else:
                oldest = min((next(iter(d.values())), gid) for gid, d in enumerate(groups) if d)[1]
                groups[oldest].popitem(last=False)
            self._size -= 1

    def clear(self) -> None:
        for d in self._by_group:
            d.clear()
        self._size = 0

    def entries(self) -> list[tuple[int, int, bytes]]:
        """(group_id, boundary, hash), oldest first."""
        rows = [(v, gid, k) for gid, d in enumerate(self._by_group) for k, v in d.items()]
        rows.sort()
        return [(gid, v & _MASK, k) for v, gid, k in rows]

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        return iter([(gid, k) for gid, _, k in self.entries()])
