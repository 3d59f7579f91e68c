"""A replica's resident entries rebuilt from its wire events, readable by the core's lookup.

The wire carries the low 64 bits of each chain hash, so the mirror keys its entries by those.
`compute_lookup(geometry, mirror, request_id, chain, num_tokens)` is handed the request's full
chain (`Chain.hashes` are whole digests): each group's index here truncates the key it is asked
for the same way, so the core's own rules run unchanged on the mirror. Two different prefixes
whose digests agree in their low 64 bits would look like one entry; with n resident entries the
chance that some request meets such a pair is about n / 2^64 per lookup (10^-13 for a million
entries), which a router can accept, and a replica's own lookup would still be exact.

The mirror knows no block ids: the value of an entry is its boundary (tokens of the prefix it
names), and that is what `slots` and `copy_src` of a mirror lookup hold. A `BlockStored` names
only its parent, so the boundary of its first block is the parent's plus one unit. The parent
is almost always resident in some group (the request that stored the block holds the page
before it), and then its boundary is read from that group's entries: the mirror remembers
exactly what the replica holds, however long it has held it, and nothing beside it but a
bounded memo of recently removed boundaries (for a parent whose page left every group before
its child was stored: a sliding window's or a chunk's old page). A parent known nowhere gives
-1 and is counted (`unknown_parents`). There is no ghost record either: `in_ghost` remembers
the last removals of each group (bounded like the core's ghost), which only refines the reason
code of a miss. Bounded memos evict in insertion order in O(1) (`OrderedDict`), at any size.

Tiers below the device (kvreuse.core.tiers) send their own events, told apart by vLLM's
`medium` field: the device's say "GPU" (or nothing, from older publishers), a tier's its own
medium ("CPU" for host memory). Each medium gets its own entries per group, in the order
`tiers` gives (then in the order media are first seen), and `tiered` is an `IndexView` over
the device and then every tier, as the replica's own lookup sees its pool and tiers: a tier
entry stands for a virtual block id below zero (`kvreuse.core.tiers.view`), so a lookup on it
says which tier each block of the hit would be loaded from.

A tier several replicas share (kvreuse.core.tiers.shared) sends its own events, in the order its
index changes whichever replica changed it; a `StoreMirror` follows them, and each replica's
mirror lists it in `shared`, so all of them read the one index (and a replica's `clear` leaves
it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from kvreuse.core import Geometry
from kvreuse.core.spi import LayeredIndex
from kvreuse.events.wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireEvent,
    hash64,
)

if TYPE_CHECKING:
    from kvreuse.events.holders import Holders


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


class StoreMirror:
    """The keys one shared tier holds (kvreuse.core.tiers.shared), per group, from the tier's
    own events (`SharedTier.take_events()` through a `Converter`): one object that the mirror
    of every replica reading the tier lists in `shared`, so a key one replica demoted is a
    hit the router sees on all of them. Its entries' values are 0: a tier entry's value only
    says where a block is, never its boundary."""

    def __init__(self, geometry: Geometry, medium: str) -> None:
        if not medium or medium == MEDIUM_GPU:
            raise ValueError(f"a shared tier's medium must name a tier, not {medium!r}")
        self.geometry, self.medium = geometry, medium
        self.index = [TruncatedIndex() for _ in geometry.groups]

    def entries(self, group_id: int) -> dict[int, int]:
        return self.index[group_id].entries

    def apply(self, events: list[WireEvent]) -> None:
        """The tier's events in order (those of another medium are ignored)."""
        for ev in events:
            if isinstance(ev, BlockStored | BlockRemoved) and ev.medium == self.medium:
                gid = ev.group_idx or 0
                if not 0 <= gid < len(self.index):
                    continue
                entries = self.index[gid].entries
                if isinstance(ev, BlockStored):
                    entries.update(dict.fromkeys(ev.block_hashes, 0))
                else:
                    for h in ev.block_hashes:
                        entries.pop(h, None)
            elif isinstance(ev, AllBlocksCleared):
                self.clear()

    def clear(self) -> None:
        for idx in self.index:
            idx.entries.clear()


class MirrorError(ValueError):
    """A batch the mirror cannot place in its geometry (checked before anything is applied)."""


class ReplicaMirror:
    """What one replica holds, per group; satisfies `kvreuse.core.IndexView`.

    `removed_memo`: how many boundaries of removed entries to remember for parents that left
    every group (default: the geometry's ghost capacity, at least 1,024)."""

    def __init__(
        self,
        geometry: Geometry,
        default_group: int = 0,
        *,
        removed_memo: int | None = None,
        tiers: Sequence[str] = (),
        shared: Sequence[StoreMirror] = (),
    ) -> None:
        self.geometry = geometry
        # media of shared tiers: their keys come from the tier's own stream, not the replica's
        self._shared = {m.medium: m for m in shared}
        self.default_group = default_group  # where events without `group_idx` go (legacy)
        self._index = [TruncatedIndex() for _ in geometry.groups]
        self.media: list[str] = []  # the tiers' media, in tier order (module docstring)
        self._tiers: list[list[TruncatedIndex]] = []  # [tier][group]
        self._tiered: _TieredView | None = None
        for medium in tiers:
            self._tier(medium)
        self._ghost: list[OrderedDict[int, None]] = [OrderedDict() for _ in geometry.groups]
        self._removed: OrderedDict[int, int] = OrderedDict()  # hash64 → boundary, left all
        if removed_memo is None:
            removed_memo = max(1024, geometry.ghost_capacity)
        if removed_memo < 1:
            raise ValueError(f"removed_memo must be at least 1, got {removed_memo}")
        self._removed_capacity = removed_memo
        self.unknown_groups = 0
        self.unknown_parents = 0
        self._watchers: list[tuple[Holders, int]] = []  # fleet indexes told of device changes

    def watch(self, holders: Holders, slot: int) -> None:
        """Report every device entry gained or lost to `holders`, as slot `slot` (what
        `Holders.attach` calls; it indexes what the mirror holds already)."""
        self._watchers.append((holders, slot))

    def unwatch(self, holders: Holders) -> None:
        self._watchers = [(h, s) for h, s in self._watchers if h is not holders]

    @property
    def index(self) -> list[TruncatedIndex]:
        return self._index

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        return hash64(key) in self._ghost[group_id]

    def entries(self, group_id: int) -> dict[int, int]:
        """hash64 → boundary (-1 if unknown) of every entry resident in the group."""
        return self._index[group_id].entries

    def tier_entries(self, tier: int, group_id: int) -> dict[int, int]:
        """hash64 → boundary (0 if unknown) of every entry tier `tier` holds in the group."""
        return self._tiers[tier][group_id].entries

    @property
    def tiered(self) -> _TieredView:
        """An IndexView over the device's entries and then each tier's (module docstring)."""
        if self._tiered is None:
            self._tiered = _TieredView(self)
        return self._tiered

    def _tier(self, medium: str) -> int:
        """The tier number of `medium`, given one when it is first seen."""
        try:
            return self.media.index(medium)
        except ValueError:
            self.media.append(medium)
            store = self._shared.get(medium)
            self._tiers.append(
                store.index if store else [TruncatedIndex() for _ in self.geometry.groups]
            )
            self._tiered = None
            return len(self.media) - 1

    def clear(self) -> None:
        """Forget the replica's entries; a shared tier's stay (its own stream clears them)."""
        own = [t for m, t in zip(self.media, self._tiers, strict=True) if m not in self._shared]
        for holders, slot in self._watchers:
            for gid, idx in enumerate(self._index):
                holders.removed(gid, list(idx.entries), slot)
        for idx in (*self._index, *(i for tier in own for i in tier)):
            idx.entries.clear()
        for ghost in self._ghost:
            ghost.clear()
        self._removed.clear()

    def check(self, events: list[WireEvent]) -> None:
        """MirrorError when a batch does not fit this geometry: a block of another size than
        the hash unit, or token ids that are not one unit per block. A subscriber checks the
        whole batch before applying any of it, so a bad batch changes nothing."""
        u = self.geometry.hash_unit
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.block_size != u:
                    raise MirrorError(
                        f"BlockStored of block_size {ev.block_size}; this geometry's hash unit "
                        f"is {u}"
                    )
                if _on_device(ev.medium) and len(ev.token_ids) != u * len(ev.block_hashes):
                    raise MirrorError(
                        f"BlockStored of {len(ev.block_hashes)} block(s) carries "
                        f"{len(ev.token_ids)} token ids, not {u} per block"
                    )

    def apply(self, events: list[WireEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                if _on_device(ev.medium):
                    self._stored(ev)
                elif ev.medium not in self._shared:
                    self._tier_stored(ev)
            elif isinstance(ev, BlockRemoved):
                gid = self._group(ev.group_idx)
                if gid is None:
                    continue
                if _on_device(ev.medium):
                    self._removed_from(gid, ev.block_hashes)
                elif ev.medium not in self._shared:
                    self._tier_removed(self._tier(str(ev.medium)), gid, ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                self.clear()

    def _tier_stored(self, ev: BlockStored) -> None:
        """A tier's keys (hashes only, as vLLM's offloading connector sends them): each keeps
        the boundary known for it, 0 when none is (a tier entry's value is never read as one)."""
        gid = self._group(ev.group_idx)
        if gid is None:
            return
        entries = self._tiers[self._tier(str(ev.medium))][gid].entries
        for h in ev.block_hashes:
            entries[h] = max(0, self.boundary(h))

    def _tier_removed(self, tier: int, gid: int, keys: list[int]) -> None:
        """A tier's keys leave it, often to land in the next tier in the same batch: their
        boundaries go to the removal memo, so the next tier (and a child stored after the
        block comes back) still knows them."""
        entries = self._tiers[tier][gid].entries
        for h in keys:
            at = entries.pop(h, 0)
            if at > 0:
                self._remember(h, at)

    def _group(self, group_idx: int | None) -> int | None:
        gid = self.default_group if group_idx is None else group_idx
        if not 0 <= gid < len(self._index):
            self.unknown_groups += 1  # a group this geometry does not have: ignored, counted
            return None
        return gid

    def boundary(self, key: int) -> int:
        """The boundary of a chain hash the replica holds in any group, or removed lately;
        -1 when unknown."""
        for idx in self._index:
            at = idx.entries.get(key, -1)
            if at >= 0:
                return at
        at = self._removed.get(key, -1)
        if at < 0:  # a parent held only in a tier (loaded back, its child is stored)
            for tier in self._tiers:
                for idx in tier:
                    if idx.entries.get(key, 0) > 0:
                        return idx.entries[key]
        return at

    def _stored(self, ev: BlockStored) -> None:
        gid = self._group(ev.group_idx)
        if gid is None:
            return
        parent = ev.parent_block_hash
        at = 0 if parent is None else self.boundary(parent)
        if at < 0:
            self.unknown_parents += 1
        entries, ghost = self._index[gid].entries, self._ghost[gid]
        size = ev.block_size
        for h in ev.block_hashes:
            at = at + size if at >= 0 else -1
            entries[h] = at
            ghost.pop(h, None)
        for holders, slot in self._watchers:
            holders.added(gid, ev.block_hashes, slot)

    def _removed_from(self, gid: int, keys: list[int]) -> None:
        entries, ghost = self._index[gid].entries, self._ghost[gid]
        ghost_capacity = max(1, self.geometry.ghost_capacity)
        removed, capacity = self._removed, self._removed_capacity
        for h in keys:
            at = entries.pop(h, None)
            if at is None:
                continue
            ghost[h] = None
            ghost.move_to_end(h)
            if len(ghost) > ghost_capacity:
                ghost.popitem(last=False)
            if at >= 0:  # `_remember`, inline: every device removal passes here
                removed[h] = at
                removed.move_to_end(h)
                if len(removed) > capacity:
                    removed.popitem(last=False)
        for holders, slot in self._watchers:
            holders.removed(gid, keys, slot)

    def _remember(self, key: int, boundary: int) -> None:
        """The boundary of a key that left, for a child or a tier that names it later."""
        removed = self._removed
        removed[key] = boundary
        removed.move_to_end(key)
        if len(removed) > self._removed_capacity:
            removed.popitem(last=False)


def _on_device(medium: str | None) -> bool:
    return medium is None or medium == MEDIUM_GPU


class _Layered(LayeredIndex):
    """A group's device entries, then its tiers': a device entry of unknown boundary (-1)
    reads as 0 here, so that only a tier's entries read below zero."""

    __slots__ = ()

    def get(self, key: bytes, default: int | None = None) -> int | None:  # type: ignore[override]
        at = self.device.get(key)
        if at is not None:
            return at if at >= 0 else 0
        return super().get(key, default)


class _TieredView:
    """The IndexView of `ReplicaMirror.tiered`: per group, the device's entries and then each
    tier's, a tier's as virtual ids (the lookup reads keys; the values only say where)."""

    __slots__ = ("index", "mirror")

    def __init__(self, mirror: ReplicaMirror) -> None:
        self.mirror = mirror
        self.index = [
            _Layered(device, [tier[gid] for tier in mirror._tiers])
            for gid, device in enumerate(mirror.index)
        ]

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        return self.mirror.in_ghost(group_id, key)


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
