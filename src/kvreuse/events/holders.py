"""Which replicas hold each key: one index over several mirrors, so a router walks a request's
chain once for the whole fleet instead of once per replica.

Per full-attention group, `masks[key]` is a bitmask of mirror slots: bit r is set exactly when
the mirror attached at slot r holds `key` on its device (`ReplicaMirror.entries`). The mirrors
keep it so: an attached mirror reports every device entry it gains or loses (`added`,
`removed`), and attaching or detaching a mirror adds or removes its whole bit. A key no mirror
holds has no mask. `check` recomputes every mask from the mirrors (tests call it).

The walk (`full_bounds`) is the core's full-attention probe (`kvreuse.core.kinds.full`) run for
every slot at once. A group of page B = k units:

    page         0            1            2            3
    full key     keys[k-1]    keys[2k-1]   keys[3k-1]   keys[4k-1]
    mask         1111         1101         1111         (none)      the walk stops here
    AND so far   1111         1101         1101

    A slot's run of leading pages ends where its bit first leaves the running AND: slot 1 (bit
    0b0010) at page 1, run 1; slots 0, 2 and 3 at page 3, run 3. The AND changes only where a
    mask value appears for the first time (AND is idempotent), so the walk reads the distinct
    values in order of first appearance, not every page. Then, as the probe does, the highest
    boundary of the page a slot missed on that the slot holds raises its F above run × B.

Only device entries are indexed: tiers below a replica's pool are looked up per replica.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, cast


class Watched(Protocol):
    """What a mirror offers the index (`kvreuse.events.ReplicaMirror` does)."""

    def entries(self, group_id: int) -> Mapping[int, int]: ...

    def watch(self, holders: Holders, slot: int) -> None: ...

    def unwatch(self, holders: Holders) -> None: ...


_SLOTS_MEMO = 4096  # masks whose slot lists are remembered (the fleet's common ones)


class Holders:
    """The masks of the full-attention groups `group_ids` over the mirrors attached to it."""

    def __init__(self, group_ids: Sequence[int]) -> None:
        self.masks: dict[int, dict[int, int]] = {gid: {} for gid in group_ids}
        self.slots: dict[int, Watched] = {}  # slot → the mirror attached there
        self.every = 0  # the mask of every attached slot
        self._slots_of: dict[int, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ attachment
    def attach(self, mirror: Watched, slot: int) -> None:
        """Index `mirror` at `slot` (free), with what it holds now; it reports changes after."""
        if slot < 0 or slot in self.slots:
            raise ValueError(f"slot {slot} is taken or negative; detach it first")
        self.slots[slot] = mirror
        self.every |= 1 << slot
        mirror.watch(self, slot)
        for gid in self.masks:
            self.added(gid, list(mirror.entries(gid)), slot)

    def detach(self, slot: int) -> None:
        """Stop indexing the mirror at `slot`: its bit leaves every mask."""
        mirror = self.slots.pop(slot)
        self.every &= ~(1 << slot)
        mirror.unwatch(self)
        for gid in self.masks:
            self.removed(gid, list(mirror.entries(gid)), slot)

    # ------------------------------------------------------------------ what mirrors report
    def added(self, gid: int, keys: Sequence[int], slot: int) -> None:
        """The mirror at `slot` holds `keys` in group `gid` (some perhaps already)."""
        masks = self.masks.get(gid)
        if masks is None:
            return
        bit, get = 1 << slot, masks.get
        for h in keys:
            masks[h] = get(h, 0) | bit

    def removed(self, gid: int, keys: Sequence[int], slot: int) -> None:
        """The mirror at `slot` no longer holds `keys` in group `gid` (a key it did not hold
        has not its bit, so it is left as it is)."""
        masks = self.masks.get(gid)
        if masks is None:
            return
        bit = 1 << slot
        for h in keys:
            m = masks.get(h, 0)
            if m & bit:
                if m == bit:
                    del masks[h]
                else:
                    masks[h] = m ^ bit

    # ------------------------------------------------------------------ reading
    def full_bounds(self, gid: int, keys: list[int], page: int, unit: int) -> list[tuple[int, int]]:
        """`(slots, F)` pairs covering every attached slot once: the covering bound F of full
        group `gid` (page `page`, hash unit `unit`) that the core's full-attention probe
        computes on the mirror of each slot in the mask `slots`, for a request whose chain's
        wire keys are `keys` (H[1] … H[n])."""
        get = self.masks[gid].get
        found = _leading(get, keys, page // unit)
        pairs: list[tuple[int, int]] = []
        left = self.every
        # the running AND changes only where a value first appears (often there is one)
        one = not found or found.count(found[0]) == len(found)
        distinct = found[:1] if one else dict.fromkeys(found)
        for mask in distinct:
            kept = left & mask
            if kept != left:
                _page_bounds(pairs, left ^ kept, found.index(mask), keys, get, page, unit)
                left = kept
                if not left:
                    return pairs
        _page_bounds(pairs, left, len(found), keys, get, page, unit)
        return pairs

    def holding(self, gid: int, keys: list[int]) -> int:
        """The mask of the slots whose mirror holds any of `keys` in group `gid`."""
        get, held = self.masks[gid].get, 0
        for key in keys:
            held |= get(key, 0)
        return held

    def slots_of(self, mask: int) -> tuple[int, ...]:
        """The slots of a mask, lowest first (remembered for the masks seen most)."""
        slots = self._slots_of.get(mask)
        if slots is None:
            if len(self._slots_of) >= _SLOTS_MEMO:
                self._slots_of.clear()
            slots = self._slots_of[mask] = tuple(
                r for r in range(mask.bit_length()) if (mask >> r) & 1
            )
        return slots

    def check(self) -> None:
        """AssertionError unless every mask is exactly the slots whose mirror holds the key."""
        every = 0
        for slot in self.slots:
            every |= 1 << slot
        if every != self.every:
            raise AssertionError(f"holders: every slot {self.every:b}, attached {every:b}")
        for gid, masks in self.masks.items():
            want: dict[int, int] = {}
            for slot, mirror in self.slots.items():
                for h in mirror.entries(gid):
                    want[h] = want.get(h, 0) | (1 << slot)
            if want != masks:
                wrong = sorted(set(want.items()) ^ set(masks.items()))[:4]
                raise AssertionError(f"holders of group {gid} differ from the mirrors: {wrong}")


_CHUNK = 64  # pages probed in the first chunk; later chunks grow ×4


def _leading(get: Callable[[int], int | None], keys: list[int], step: int) -> list[int]:
    """The masks of the leading full pages (page j's full key is `keys[(j + 1)·step − 1]`), up
    to the first page no slot holds. `map` over a chunk is one C loop; a chunk that holds the
    miss is cut there, so a short hit on a long prompt probes about one chunk."""
    found: list[int | None] = []
    lo, chunk, end = step - 1, _CHUNK * step, len(keys)
    while lo < end:
        if found and get(keys[lo]) is None:  # the miss opens this chunk: spare its probes
            break
        part = list(map(get, keys[lo : lo + chunk : step]))
        try:  # one scan for the miss (`None in part` then `index` would be two)
            miss = part.index(None)
        except ValueError:
            found += part
        else:
            found += part[:miss]
            break
        lo, chunk = lo + chunk, chunk * 4
    return cast(list[int], found)  # every None was cut off above


def _page_bounds(
    pairs: list[tuple[int, int]],
    slots: int,
    run: int,
    keys: list[int],
    get: Callable[[int, int], int],
    page: int,
    unit: int,
) -> None:
    """F of `slots` (a mask) whose run of leading pages is `run`: run × page, raised to the
    highest boundary of the next page that a slot holds (its full key was the miss; a last
    partial page has no full key, and its boundaries are searched from the chain's end)."""
    base = run * page
    if page == unit:  # a page is one unit: the full key is its only boundary
        pairs.append((slots, base))
        return
    nu = len(keys) * unit
    start = base + page - unit if base + page <= nu else nu
    for b in range(start, base, -unit):
        have = slots & get(keys[b // unit - 1], 0)
        if have:
            pairs.append((have, b))
            slots ^= have
            if not slots:
                return
    pairs.append((slots, base))
