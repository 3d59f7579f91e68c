"""A replica's resident entries rebuilt from its wire events, readable by the core's lookup.

The wire carries the low 64 bits of each chain hash, so the mirror keys its entries by those.
`compute_lookup(geometry, mirror, request_id, chain, num_tokens)` is handed the request's full
chain (`Chain.hashes` are whole digests): each group's index here truncates the key it is asked
for the same way, so the core's own rules run unchanged on the mirror. Two different prefixes
whose digests agree in their low 64 bits would look like one entry; with n resident entries the
chance that some request meets such a pair is about n / 2^64 per lookup (10^-13 for a million
entries), which a router can accept, and a replica's own lookup would still be exact.

The mirror knows no block ids: the value of an entry is its boundary (tokens of the prefix it
names) when the parent chain told it, else -1, and that is what `slots` and `copy_src` of a
mirror lookup hold. It has no ghost record either: `in_ghost` remembers the last removals of
each group (bounded like the core's ghost), which only refines the reason code of a miss.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from kvreuse.core import Geometry
from kvreuse.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, WireEvent, hash64


class TruncatedIndex(Mapping[bytes, int]):
    """One group's entries, looked up by a full digest through its low 64 bits."""

    __slots__ = ("entries",)

    def __init__(self) -> None:
        self.entries: dict[int, int] = {}  # hash64 → boundary (-1 if unknown)

    def __getitem__(self, key: bytes) -> int:
        return self.entries[hash64(key)]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and hash64(key) in self.entries

    def get(self, key: bytes, default: int | None = None) -> int | None:  # type: ignore[override]
        return self.entries.get(hash64(key), default)

    def __iter__(self) -> Iterator[bytes]:
        return (h.to_bytes(8, "big") for h in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


class ReplicaMirror:
    """What one replica holds, per group; satisfies `kvreuse.core.IndexView`."""

    def __init__(self, geometry: Geometry, default_group: int = 0) -> None:
        self.geometry = geometry
        self.default_group = default_group  # where events without `group_idx` go (legacy)
        self._index = [TruncatedIndex() for _ in geometry.groups]
        self._ghost: list[dict[int, None]] = [{} for _ in geometry.groups]
        self._boundaries: dict[int, int] = {}  # hash64 → boundary, learned from parent links
        keys = geometry.num_blocks * geometry.max_keys_per_block
        self._boundaries_capacity = max(1 << 16, 2 * keys)
        self.unknown_groups = 0

    @property
    def index(self) -> list[TruncatedIndex]:
        return self._index

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        return hash64(key) in self._ghost[group_id]

    def entries(self, group_id: int) -> dict[int, int]:
        """hash64 → boundary (-1 if unknown) of every entry resident in the group."""
        return self._index[group_id].entries

    def clear(self) -> None:
        for idx in self._index:
            idx.entries.clear()
        for ghost in self._ghost:
            ghost.clear()
        self._boundaries.clear()

    def apply(self, events: list[WireEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self._stored(ev)
            elif isinstance(ev, BlockRemoved):
                gid = self._group(ev.group_idx)
                if gid is None:
                    continue
                entries, ghost = self._index[gid].entries, self._ghost[gid]
                for h in ev.block_hashes:
                    if entries.pop(h, None) is not None:
                        self._remember_removal(ghost, h)
            elif isinstance(ev, AllBlocksCleared):
                self.clear()

    def _group(self, group_idx: int | None) -> int | None:
        gid = self.default_group if group_idx is None else group_idx
        if not 0 <= gid < len(self._index):
            self.unknown_groups += 1  # a group this geometry does not have: ignored, counted
            return None
        return gid

    def _stored(self, ev: BlockStored) -> None:
        gid = self._group(ev.group_idx)
        if gid is None:
            return
        parent = ev.parent_block_hash
        at = 0 if parent is None else self._boundaries.get(parent, -1)
        entries, ghost = self._index[gid].entries, self._ghost[gid]
        for h in ev.block_hashes:
            at = at + ev.block_size if at >= 0 else -1
            if at >= 0:
                if len(self._boundaries) >= self._boundaries_capacity:
                    del self._boundaries[next(iter(self._boundaries))]
                self._boundaries[h] = at
            entries[h] = at
            ghost.pop(h, None)

    def _remember_removal(self, ghost: dict[int, None], h: int) -> None:
        if len(ghost) >= max(1, self.geometry.ghost_capacity):
            del ghost[next(iter(ghost))]
        ghost[h] = None


class HashChain:
    """A request's chain given as its hashes `[H[0], …, H[n]]` (a `ChainView` for the lookup)."""

    __slots__ = ("hashes",)

    def __init__(self, hashes: list[bytes]) -> None:
        if not hashes:
            raise ValueError("a chain holds at least its root H[0]")
        self.hashes = hashes

    @property
    def num_units(self) -> int:
        return len(self.hashes) - 1
