"""The block pool (spec §11): reference counts, keys, the index, the ghost record, eviction.

One id space serves every group. Per-block metadata lives in flat arrays (no object per block):

    block id   0      1      2      3   …
    ref        -      2      0      0          ref > 0: in use;  ref == 0: in the free queue
    group      -      0      0      1          -1 while neither keyed nor referenced
    keys       -      {}     {16,32} {48}      a block carries keys of one group only

A block's first key is stored inline (`_key1`/`_b1`); only blocks with several keys (sub-page
entries of a large page) pay for a list. The index maps, per group, chain hash → block id.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

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
        self.ref = array("l", bytes(8 * n))
        self.group = array("b", b"\xff" * n)
        self._key1: list[bytes | None] = [None] * n
        self._b1 = array("l", bytes(8 * n))
        self._more: dict[int, list[tuple[int, bytes]]] = {}
        self._release_seq = array("l", bytes(8 * n))
        self._batch = 0
        self.index: list[dict[bytes, int]] = [{} for _ in geo.groups]
        self.ghost: OrderedDict[tuple[int, bytes], int] = OrderedDict()
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
        out = [(self._b1[block_id], h)]
        more = self._more.get(block_id)
        if more:
            out.extend(more)
            out.sort()
        return out

    def has_keys(self, block_id: int) -> bool:
        return self._key1[block_id] is not None

    def num_keys(self, block_id: int) -> int:
        if self._key1[block_id] is None:
            return 0
        return 1 + len(self._more.get(block_id, ()))

    def max_boundary(self, block_id: int) -> int:
        best = self._b1[block_id]
        for b, _ in self._more.get(block_id, ()):
            best = max(best, b)
        return best

    def publish(self, group_id: int, boundary: int, key: bytes, block_id: int) -> bool:
        """Key `block_id` at `boundary`; False (nothing changes) if the key already exists."""
        idx = self.index[group_id]
        if key in idx:
            return False
        idx[key] = block_id
        if self._key1[block_id] is None:
            self._key1[block_id] = key
            self._b1[block_id] = boundary
        else:
            self._more.setdefault(block_id, []).append((boundary, key))
        self.group[block_id] = group_id
        if self.ghost:
            self.ghost.pop((group_id, key), None)
        self.num_published[self.kind_of(group_id, boundary)] += 1
        return True

    # ------------------------------------------------------------------ references
    def adopt(self, block_id: int) -> None:
        """Add a reference; a block with count 0 leaves the free queue (a hit is adopted)."""
        if self.ref[block_id] == 0:
            self.policy.remove(block_id)
        self.ref[block_id] += 1

    def pop(self, group_id: int) -> int:
        """Hand out the policy's next block with count 1, evicting its keys first."""
        block_id = self.policy.pop()
        if self._key1[block_id] is not None:
            self._evict_keys(block_id)
        self.ref[block_id] = 1
        self.group[block_id] = group_id
        return block_id

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
        seq = self._batch
        key1 = self._key1
        unkeyed: list[int] = []
        keyed: list[int] = []
        for b in zero:
            self._release_seq[b] = seq
            if key1[b] is None:
                self.group[b] = -1
                unkeyed.append(b)
            else:
                keyed.append(b)
        if len(keyed) > 1:
            group = self.group
            keyed.sort(key=lambda b: (-self.max_boundary(b), group[b], b))
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
        ghost = self.ghost
        cap = self.ghost_capacity
        for b, key in self.key_list(block_id):
            del idx[key]
            if events.enabled:
                events.removed(g, key, b, self.kind_of(g, b))
            if cap:
                ghost[(g, key)] = b
                if len(ghost) > cap:
                    ghost.popitem(last=False)
            self.num_removed_keys += 1
        self._key1[block_id] = None
        self._more.pop(block_id, None)
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
        return (group_id, key) in self.ghost
