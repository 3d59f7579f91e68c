"""The block pool (spec §11): reference counts, keys, the index, the ghost record, eviction.

One id space serves every group. Per-block metadata lives in flat arrays (no object per block):

    block id   0      1      2      3   …
    ref        -      2      0      0          ref > 0: in use;  ref == 0: in the free queue
    group      -      0      0      1          -1 while neither keyed nor referenced
    keys       -      {}     {16,32} {48}      a block carries keys of one group only

A block's highest key is stored inline (`_key1`/`_b1`, so `_b1` is also the boundary the release
order sorts by); only blocks with several keys (sub-page entries of a large page) keep the lower
ones in a list. The index maps, per group, chain hash → block id. Arrays are 32-bit: block ids
and token positions stay below 2³¹.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvreuse.core.ghost import GHOST_SHIFT, GhostRecord
from kvreuse.core.policy import EvictionPolicy, LRUPolicy

if TYPE_CHECKING:
    from kvreuse.core.config import CacheConfig, Geometry
    from kvreuse.core.events import EventLog

NULL = 0


class BlockPool:
    """Blocks, their reference counts and keys, and the index that finds them by hash."""

    def __init__(self, cfg: CacheConfig, events: EventLog) -> None:
        geo = cfg.geometry
        n = geo.num_blocks
        self.geo: Geometry = geo
        self.num_blocks = n
        self.events = events
        self.ref = array("i", bytes(4 * n))
        self.group = array("b", b"\xff" * n)
        self._key1: list[bytes | None] = [None] * n
        self._b1 = array("i", bytes(4 * n))
        self._more: dict[int, list[tuple[int, bytes]]] = {}
        # release_seq is only read by custom policies (§11.4); LRU does not pay for it.
        self._lru = cfg.eviction_policy == "lru"
        self._release_seq = None if self._lru else array("q", bytes(8 * n))
        self._batch = 0
        self.index: list[dict[bytes, int]] = [{} for _ in geo.groups]
        self.ghost = GhostRecord(len(geo.groups), geo.ghost_capacity)
        self.ghost_capacity = geo.ghost_capacity
        self._full_page = [g.page_size if g.is_attention else 0 for g in geo.groups]
        self.num_evicted_blocks = 0
        self.num_removed_keys = 0
        self.num_published = {"full": 0, "partial": 0, "state": 0}
        if cfg.eviction_policy == "lru":
            self.policy: EvictionPolicy = LRUPolicy(n)
        else:
            self.policy = cfg.eviction_policy(self)
        self.policy.release(list(range(1, n)), [])

    # ------------------------------------------------------------------ PoolView
    def ref_count(self, block_id: int) -> int:
        return self.ref[block_id]

    def group_id(self, block_id: int) -> int | None:
        g = self.group[block_id]
        return None if g < 0 else g

    def keys(self, block_id: int) -> list[tuple[int, str]]:
        return [(b, self.kind_of(self.group[block_id], b)) for b, _ in self.key_list(block_id)]

    def release_seq(self, block_id: int) -> int:
        if self._release_seq is None:
            raise ValueError(
                "release_seq is tracked only for custom eviction policies (the built-in LRU "
                "does not read it); configure eviction_policy=<factory> to use it"
            )
        return self._release_seq[block_id]

    # ------------------------------------------------------------------ keys
    def kind_of(self, group_id: int, boundary: int) -> str:
        page = self._full_page[group_id]
        if not page:
            return "state"
        return "full" if boundary % page == 0 else "partial"

    def key_list(self, block_id: int) -> list[tuple[int, bytes]]:
        """The keys of a block as (boundary, hash), ascending by boundary."""
        h = self._key1[block_id]
        if h is None:
            return []
        more = self._more.get(block_id)
        top = (self._b1[block_id], h)
        return [*more, top] if more else [top]

    def has_keys(self, block_id: int) -> bool:
        return self._key1[block_id] is not None

    def publish(self, group_id: int, boundary: int, key: bytes, block_id: int) -> bool:
        """Key `block_id` at `boundary`; False (nothing changes) if the key already exists."""
        idx = self.index[group_id]
        if key in idx:
            return False
        idx[key] = block_id
        self._attach(block_id, boundary, key)
        self.group[block_id] = group_id
        if self.ghost:
            self.ghost.discard(group_id, key)
        page = self._full_page[group_id]
        self.num_published["state" if not page else "partial" if boundary % page else "full"] += 1
        return True

    def _attach(self, block_id: int, boundary: int, key: bytes) -> None:
        old = self._key1[block_id]
        if old is None:
            self._key1[block_id] = key
            self._b1[block_id] = boundary
            return
        more = self._more.setdefault(block_id, [])
        if boundary > self._b1[block_id]:  # the usual case: publication is ascending
            more.append((self._b1[block_id], old))
            self._key1[block_id] = key
            self._b1[block_id] = boundary
        else:
            more.append((boundary, key))
            more.sort()

    def publish_run(
        self, group_id: int, boundaries: range, hashes: list[bytes], row: list[int], page: int
    ) -> list[int]:
        """Publish each boundary b of `boundaries` on `row[(b-1)//page]` (attention, 10.3).

        Skips NULL pages and existing keys; returns the boundaries published, ascending. This is
        `publish` in a loop with the lookups hoisted out, because commit runs it per boundary.
        """
        idx, key1, b1, group = self.index[group_id], self._key1, self._b1, self.group
        ghost = self.ghost
        ghost_g = ghost.by_group[group_id]
        u = boundaries.step
        keys = hashes[boundaries.start // u : boundaries.stop // u + (boundaries.stop % u > 0)]
        if page == u:  # every boundary is a page end: the pages are a plain slice of the row
            blocks = row[boundaries.start // u - 1 : boundaries.start // u - 1 + len(keys)]
            if NULL not in blocks and idx.keys().isdisjoint(keys):
                return self._publish_pages(group_id, boundaries, keys, blocks)
        else:
            blocks = [row[(b - 1) // page] for b in boundaries]
        done: list[int] = []
        partial = 0
        for b, key, blk in zip(boundaries, keys, blocks, strict=True):
            if not blk or key in idx:
                continue
            idx[key] = blk
            if key1[blk] is None:
                key1[blk] = key
                b1[blk] = b
            else:
                self._attach(blk, b, key)
            group[blk] = group_id
            if ghost_g and ghost_g.pop(key, None) is not None:
                ghost.size -= 1
            done.append(b)
            partial += b % page != 0
        self.num_published["partial"] += partial
        self.num_published["full"] += len(done) - partial
        return done

    def _publish_pages(
        self, group_id: int, boundaries: range, keys: list[bytes], blocks: list[int]
    ) -> list[int]:
        """`publish_run` when page = unit and none of the keys exists: one full key per block.

        The blocks are the request's own fresh pages (one boundary each, never keyed before),
        so the index takes the keys in one C-level update and each block its single key.
        """
        self.index[group_id].update(zip(keys, blocks, strict=True))
        key1, b1, group = self._key1, self._b1, self.group
        for blk, key, b in zip(blocks, keys, boundaries, strict=True):
            key1[blk] = key
            b1[blk] = b
            group[blk] = group_id
        ghost = self.ghost
        ghost_g = ghost.by_group[group_id]
        if ghost_g:
            for key in ghost_g.keys() & set(keys):
                del ghost_g[key]
                ghost.size -= 1
        self.num_published["full"] += len(keys)
        return list(boundaries)

    # ------------------------------------------------------------------ references
    def adopt(self, block_id: int) -> None:
        """Add a reference; a block with count 0 leaves the free queue (a hit is adopted)."""
        if self.ref[block_id] == 0:
            self.policy.remove(block_id)
        self.ref[block_id] += 1

    def adopt_many(self, blocks: Iterable[int]) -> None:
        ref, remove = self.ref, self.policy.remove
        for b in blocks:
            c = ref[b]
            if not c:
                remove(b)
            ref[b] = c + 1

    def pop(self, group_id: int) -> int:
        """Hand out the policy's next block with count 1, evicting its keys first."""
        block_id = self.policy.pop()
        if self._key1[block_id] is not None:
            self._evict_keys(block_id)
        self.ref[block_id] = 1
        self.group[block_id] = group_id
        return block_id

    def pop_many(self, group_id: int, count: int) -> list[int]:
        """`pop` × count: the same blocks, order and evictions, with one unlink under LRU."""
        if count <= 0:
            return []
        if not self._lru:
            return [self.pop(group_id) for _ in range(count)]
        out = self.policy.pop_many(count)  # type: ignore[attr-defined]
        key1, ref, group, b1 = self._key1, self.ref, self.group, self._b1
        slow = self.events.enabled or bool(self._more)
        ghost, index = self.ghost, self.index
        ghosts = ghost.by_group if ghost.capacity else None
        seq = ghost.seq
        evicted = 0
        for b in out:
            key = key1[b]
            if key is not None:
                if slow:
                    self._evict_keys(b)
                else:  # one key, no events: `_evict_keys` inlined (the hot path under pressure)
                    g = group[b]
                    del index[g][key]
                    if ghosts is not None:  # GhostRecord.add, trimmed once below
                        seq += 1
                        ghosts[g][key] = seq << GHOST_SHIFT | b1[b]
                    key1[b] = None
                    evicted += 1
            ref[b] = 1
            group[b] = group_id
        if evicted:
            self.num_removed_keys += evicted
            self.num_evicted_blocks += evicted
            if ghosts is not None:
                ghost.seq = seq
                ghost.size += evicted
                ghost.trim()
        return out

    def release(self, ordered: Iterable[int]) -> None:
        """Drop one reference per occurrence; queue the blocks that reach 0 as one batch.

        `ordered` lists the references in the unkeyed run order of spec §11.2 (ascending group,
        descending table position, …); keyed blocks are re-sorted for the tail.
        """
        ref = self.ref
        zero: list[int] = []
        for b in ordered:
            c = ref[b] - 1
            ref[b] = c
            if c == 0:
                zero.append(b)
        if not zero:
            return
        self._queue(zero)

    def _queue(self, zero: list[int]) -> None:
        self._batch += 1
        if self._release_seq is not None:
            for b in zero:
                self._release_seq[b] = self._batch
        key1 = self._key1
        unkeyed: list[int] = []
        keyed: list[int] = []
        for b in zero:
            if key1[b] is None:
                self.group[b] = -1
                unkeyed.append(b)
            else:
                keyed.append(b)
        if len(keyed) > 1:
            # Decreasing highest boundary, then ascending group, then ascending id: three
            # stable C-level sorts, least significant first (reverse=True keeps ties stable).
            keyed.sort()
            if len(self.index) > 1:
                keyed.sort(key=self.group.__getitem__)
            keyed.sort(key=self._b1.__getitem__, reverse=True)
        self.policy.release(unkeyed, keyed)

    # ------------------------------------------------------------------ eviction and reset
    def evict(self, block_id: int) -> None:
        """Targeted eviction (test support): remove the keys now, keep the queue position."""
        if block_id == NULL or not 0 < block_id < self.num_blocks:
            raise ValueError(f"evict: block {block_id} is the null block or out of range")
        if self.ref[block_id] != 0:
            raise ValueError(f"evict: block {block_id} is in use (ref {self.ref[block_id]})")
        if self._key1[block_id] is None:
            raise ValueError(f"evict: block {block_id} carries no key")
        self._evict_keys(block_id)
        self.group[block_id] = -1

    def _evict_keys(self, block_id: int) -> None:
        g = self.group[block_id]
        idx = self.index[g]
        events = self.events
        add_ghost = self.ghost.add
        more = self._more.pop(block_id, None)
        pairs = (
            [*more, (self._b1[block_id], self._key1[block_id])]
            if more
            else ((self._b1[block_id], self._key1[block_id]),)
        )
        for b, key in pairs:
            del idx[key]
            if events.enabled:
                events.removed(g, key, b, self.kind_of(g, b))
            add_ghost(g, key, b)
            self.num_removed_keys += 1
        self._key1[block_id] = None
        self.num_evicted_blocks += 1

    def clear_keys(self) -> None:
        """`reset()`: drop every key and the ghost record; the queue order is untouched."""
        for idx in self.index:
            idx.clear()
        self.ghost.clear()
        for b in range(1, self.num_blocks):
            if self._key1[b] is not None:
                self._key1[b] = None
                if self.ref[b] == 0:
                    self.group[b] = -1
        self._more.clear()

    # ------------------------------------------------------------------ gauges
    @property
    def num_free(self) -> int:
        return len(self.policy)

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        return key in self.ghost.by_group[group_id]
