"""A lookup across the pool and its tiers.

The lookup rules (kvreuse.core.lookup) read an `IndexView`; `TierView` is one whose index of each
group is the pool's index, then each tier's in order, a tier entry standing for a *virtual*
block id below zero:

    virtual id  =  −(1 + t·2³² + slot)      t: the tier, slot: its slot number
    0           =  NULL (a page the hit does not need), as in the pool's own rows

So the hit is the largest x every group accepts over everything held anywhere, by the same
rules: a hit whose recurrent state, window page or DCP-sharded page no tier kept is no hit, as
on the device alone. The slots of such a result name the blocks to adopt and, below zero, the
tier slots to load (`tier_sources`; kvreuse.core.tiers.loads loads them).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

from kvreuse.core.lookup import LookupResult
from kvreuse.core.pool import BlockPool
from kvreuse.core.tiers.stack import TierStack

_TIER_STRIDE = 1 << 32


def virtual_id(t: int, slot: int) -> int:
    return -(1 + t * _TIER_STRIDE + slot)


def source_of(virtual: int) -> tuple[int, int]:
    """(tier, slot) of a virtual block id."""
    v = -virtual - 1
    return v // _TIER_STRIDE, v % _TIER_STRIDE


class LayeredIndex(Mapping[bytes, int]):
    """One group's keys: the pool's index first, then each tier's (as virtual ids)."""

    __slots__ = ("device", "tiers")

    def __init__(self, device: Mapping[bytes, int], tiers: list[Mapping[bytes, int]]) -> None:
        self.device, self.tiers = device, tiers

    def get(self, key: bytes, default: int | None = None) -> int | None:  # type: ignore[override]
        blk = self.device.get(key)
        if blk is not None:
            return blk
        for t, idx in enumerate(self.tiers):
            slot = idx.get(key)
            if slot is not None:
                return virtual_id(t, slot)
        return default

    def __getitem__(self, key: bytes) -> int:
        blk = self.get(key)
        if blk is None:
            raise KeyError(key)
        return blk

    def __contains__(self, key: object) -> bool:
        return key in self.device or any(key in idx for idx in self.tiers)

    def __iter__(self) -> Iterator[bytes]:
        seen = set(self.device)
        yield from self.device
        for idx in self.tiers:
            for key in idx:
                if key not in seen:
                    seen.add(key)
                    yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)


class TierView:
    """An IndexView over the pool and its tiers (the module docstring)."""

    def __init__(self, pool: BlockPool, tiers: TierStack) -> None:
        self.pool = pool
        self.index: list[LayeredIndex] = [
            LayeredIndex(pool.index[gid], [tier.index[gid] for tier in tiers.tiers])
            for gid in range(len(pool.index))
        ]

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        return self.pool.in_ghost(group_id, key)


def tier_sources(res: LookupResult) -> list[tuple[int, int, int]]:
    """(group id, tier, slot) of every block of the hit that must be loaded, in group order
    and, within a group, table order (the recurrent source last)."""
    out: list[tuple[int, int, int]] = []
    for gid in sorted(set(res.slots) | set(res.state_src)):
        for blk in res.slots.get(gid, ()):
            if blk < 0:
                out.append((gid, *source_of(blk)))
        src = res.state_src.get(gid)
        if src is not None and src < 0:
            out.append((gid, *source_of(src)))
    return out


def tier_hit_tokens(res: LookupResult, group_id: int, page_size: int, num_tiers: int) -> list[int]:
    """Per tier, the tokens of the hit on the pages of group `group_id` (a full-attention
    group, pages of `page_size` tokens) that the hit loads from that tier: what a tier gives
    back, counted as the hit counters count tokens."""
    out = [0] * num_tiers
    for j, blk in enumerate(res.slots.get(group_id, ())):
        if blk < 0:
            out[source_of(blk)[0]] += min((j + 1) * page_size, res.hit) - j * page_size
    return out


def device_hits(blocks: Sequence[int]) -> list[int]:
    return [b for b in blocks if b > 0]
