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

Each rule has one home here: a key enters the index only through `publish`, leaves it only
through `_evict_keys` (or all at once through `clear_keys`), and each of them records its own
events, so the event log mirrors the index by construction.

On the native path (`kvreuse.core.native`) the per-block loops of publication, adoption,
release and eviction run as C kernels over these same arrays, bound once by name in a
`BlockTable`; each is called from one method here, whose Python loop is the reference it is
tested against and whose docstring is the contract of both. Both call the eviction policy only
once the counts of the operation are final, so every policy (the built-in LRU or a custom one)
sees the same pool on either path.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from kvreuse.core import native
from kvreuse.core.events import stored_runs
from kvreuse.core.ghost import Ghost, new_ghost
from kvreuse.core.kinds import EntryKind, count_entry_kinds, entry_kind
from kvreuse.core.policy import EvictionPolicy, batch_order, policy_factory, pop_many_of

if TYPE_CHECKING:
    from kvreuse.core.config import CacheConfig, Geometry
    from kvreuse.core.events import EventLog
    from kvreuse.core.request import RequestState

NULL = 0
_FULL = EntryKind.FULL


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
        self._batch = 0
        self.index: list[dict[bytes, int]] = [{} for _ in geo.groups]
        self.ghost: Ghost = new_ghost(len(geo.groups), geo.ghost_capacity)  # C on the native path
        self.ghost_capacity = geo.ghost_capacity
        self._unit = geo.hash_unit
        # Per group, its kind's event shape: the page `entry_kind` takes (0: states) and the
        # page that joins BlockStored runs of states (0: attention).
        self._full_page = [g.entry_page for g in geo.groups]
        self._state_page = [g.run_page for g in geo.groups]
        self.num_evicted_blocks = 0
        self.num_removed_keys = 0
        self.num_published: dict[str, int] = {kind.value: 0 for kind in EntryKind}
        # Called with (block id, group id, keys) of the keyed blocks an eviction takes, before
        # they are reused: the tiers below copy them down (kvreuse.core.tiers).
        self.on_evict: Callable[[list[tuple[int, int, list[tuple[int, bytes]]]]], None] | None = (
            None
        )
        # Called the same way with the blocks a publication keyed, after their BlockStored
        # events: a tier that writes their kind through copies them (kvreuse.core.tiers).
        self.on_publish: Callable[[list[tuple[int, int, list[tuple[int, bytes]]]]], None] | None = (
            None
        )
        self.policy: EvictionPolicy = policy_factory(cfg.eviction_policy)(self)
        self._pop_many = pop_many_of(self.policy)
        # PoolView.release_seq costs 8 bytes a block: kept only for a policy that reads it (a
        # custom one, unless it says otherwise; the built-in LRU does not, D8).
        reads = getattr(self.policy, "reads_release_seq", True)
        self._release_seq = array("q", bytes(8 * n)) if reads else None
        # The C kernels of the per-block loops (native.py), on these same arrays. The functions
        # are kept, not the module: a manager stays deep-copyable and picklable.
        k = native.ext
        self._table = (
            None
            if k is None
            else k.BlockTable(self.ref, self.group, self._b1, self._key1, self._more, self.index)
        )
        self._k_adopt = k.ref_adopt if k is not None else None
        self._k_release = k.release_refs if k is not None else None
        self._k_evict = k.evict_keys if k is not None else None
        self._k_publish = k.publish_keys if k is not None else None
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
                "release_seq is tracked only for an eviction policy that reads it (the built-in "
                "LRU does not); configure eviction_policy=<factory> to use it"
            )
        return self._release_seq[block_id]

    # ------------------------------------------------------------------ keys
    def kind_of(self, group_id: int, boundary: int) -> EntryKind:
        return entry_kind(self._full_page[group_id], boundary)

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

    def publish(
        self,
        group_id: int,
        boundaries: Sequence[int],
        keys: Sequence[bytes],
        blocks: Sequence[int],
        source: RequestState,
    ) -> list[int]:
        """Key `blocks[i]` at `boundaries[i]` (ascending) with `keys[i]`; the one publication.

        Attention publication (many boundaries of one commit), settled recurrent saves and the
        finish state all come here. Returns the boundaries published, ascending, and records
        their BlockStored events: `source` is the request whose tokens and chain the events are
        built from when they are taken.
        """
        if self._k_publish is not None:
            done, fresh = self._k_publish(self._table, group_id, blocks, keys, boundaries)
            if fresh:
                self._published(group_id, done, fresh)
        else:
            done = self._publish_each(group_id, boundaries, keys, blocks)
        if done and self.events.enabled:
            stored = self.events.stored
            for run in stored_runs(done, self._unit, self._state_page[group_id]):
                stored(source, group_id, run)
        if done and self.on_publish is not None:
            at = dict(zip(boundaries, blocks, strict=True))
            keyed = dict.fromkeys(at[b] for b in done)
            self.on_publish([(blk, group_id, self.key_list(blk)) for blk in keyed])
        return done

    def _publish_each(
        self, group_id: int, boundaries: Sequence[int], keys: Sequence[bytes], blocks: Sequence[int]
    ) -> list[int]:
        """The loop of `publish` (the `publish_keys` kernel's contract): entry by entry, a NULL
        block (a page that left its window) or a key already in the group's index (the first
        publisher keeps it) is skipped; otherwise the index maps the key to the block, which
        carries it as its highest key (the one before joins its lower keys) or, below its
        highest, among its lower keys (ascending) and belongs to the group. Returns the
        boundaries keyed; their keys leave the ghost record and are counted by kind.

        Its most common data, a prefill of pages of one unit each (page = unit) with no NULL
        block and no key present or repeated, skips nothing: the index then takes every key in
        one C-level update, and the loop only places each key on its block."""
        idx, key1, b1, group = self.index[group_id], self._key1, self._b1, self.group
        bulk = False
        if self._full_page[group_id] == self._unit and NULL not in blocks:
            new = dict(zip(keys, blocks, strict=True))
            bulk = len(new) == len(keys) and idx.keys().isdisjoint(new)
            if bulk:
                idx.update(new)
        done: list[int] = list(boundaries) if bulk else []
        fresh: list[bytes] = list(keys) if bulk else []
        for b, key, blk in zip(boundaries, keys, blocks, strict=True):
            if not bulk:
                if not blk or key in idx:
                    continue
                idx[key] = blk
                done.append(b)
                fresh.append(key)
            if key1[blk] is None:
                key1[blk] = key
                b1[blk] = b
            else:
                self._attach(blk, b, key)
            group[blk] = group_id
        if fresh:
            self._published(group_id, done, fresh)
        return done

    def _published(self, group_id: int, done: list[int], fresh: list[bytes]) -> None:
        """Settle what a publication keyed: its keys leave the ghost record, its entries are
        counted by kind."""
        self.ghost.discard_many(group_id, fresh)
        page = self._full_page[group_id]
        if page == self._unit:  # one boundary per page: every entry ends its page
            self.num_published[_FULL] += len(done)
        else:
            count_entry_kinds(self.num_published, page, done)

    def _attach(self, block_id: int, boundary: int, key: bytes) -> None:
        """Add a key to a block that already carries one (sub-page entries of a large page)."""
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

    # ------------------------------------------------------------------ references
    def adopt(self, block_id: int) -> None:
        """Add a reference; a block with count 0 leaves the free queue (a hit is adopted)."""
        if self.ref[block_id] == 0:
            self.policy.remove(block_id)
        self.ref[block_id] += 1

    def adopt_many(self, blocks: Iterable[int]) -> None:
        """A reference more on each of `blocks` (one per occurrence); those whose count was 0
        then leave the free queue, in the order given (the `ref_adopt` kernel's contract)."""
        if self._k_adopt is not None:
            zero = self._k_adopt(self._table, blocks)
        else:
            zero = []
            ref = self.ref
            for b in blocks:
                c = ref[b]
                if not c:
                    zero.append(b)
                ref[b] = c + 1
        remove = self.policy.remove
        for b in zero:
            remove(b)

    def pop(self, group_id: int) -> int:
        """Hand out the policy's next block with count 1, evicting its keys first."""
        return self.pop_many(group_id, 1)[0]

    def pop_many(self, group_id: int, count: int) -> list[int]:
        """The policy's next `count` blocks, each with count 1, their keys evicted first."""
        if count <= 0:
            return []
        out = self._pop_many(count)
        self._evict_keys(out, group_id, 1)
        return out

    def release(self, ordered: Iterable[int]) -> None:
        """Drop one reference per occurrence; queue the blocks that reach 0 as one batch.

        `ordered` lists the references in the unkeyed run order of spec §11.2 (ascending group,
        descending table position, …); the batch reaches the policy as (unkeyed, keyed), the
        keyed run in `batch_order`, numbered for `release_seq` where the policy reads it.
        """
        if self._k_release is not None:
            split = self._k_release(self._table, ordered)
        else:
            split = self._release_each(ordered)
        if split is None:
            return
        self._batch += 1
        seq = self._release_seq
        if seq is not None:
            batch = self._batch
            for run in split:
                for b in run:
                    seq[b] = batch
        self.policy.release(*split)

    def _release_each(self, ordered: Iterable[int]) -> tuple[list[int], list[int]] | None:
        """The loop of `release` (the `release_refs` kernel's contract): each occurrence drops a
        reference; a block that reaches 0 joins the unkeyed run (losing its group) or the keyed
        one as it does. Returns (unkeyed, keyed in `batch_order`), or None when none reached 0."""
        ref, key1, group = self.ref, self._key1, self.group
        unkeyed: list[int] = []
        keyed: list[int] = []
        for b in ordered:
            c = ref[b] - 1
            ref[b] = c
            if c == 0:
                if key1[b] is None:
                    group[b] = -1
                    unkeyed.append(b)
                else:
                    keyed.append(b)
        if not unkeyed and not keyed:
            return None
        batch_order(keyed, self._b1, self.group, len(self.index) > 1)
        return unkeyed, keyed

    # ------------------------------------------------------------------ eviction and reset
    def evict(self, block_id: int) -> None:
        """Targeted eviction (test support): remove the keys now, keep the queue position."""
        if block_id == NULL or not 0 < block_id < self.num_blocks:
            raise ValueError(f"evict: block {block_id} is the null block or out of range")
        if self.ref[block_id] != 0:
            raise ValueError(f"evict: block {block_id} is in use (ref {self.ref[block_id]})")
        if self._key1[block_id] is None:
            raise ValueError(f"evict: block {block_id} carries no key")
        self._evict_keys((block_id,), -1, 0)

    def _evict_keys(self, blocks: Iterable[int], group_id: int, ref_count: int) -> None:
        """Evict every key of `blocks`, then give each block `group_id` and `ref_count`.

        The one way a key is evicted: `pop_many` hands its blocks out (the popping group, count
        1), a targeted `evict` leaves its block queued (no group, count 0). Each key leaves the
        index for the ghost record with one BlockRemoved event, in block order and ascending
        boundary within a block.
        """
        victims = None
        if self.on_evict is not None:  # tiers below: what each block carried, before it goes
            blocks = list(blocks)
            victims = [(b, self.group[b], self.key_list(b)) for b in blocks if self._key1[b]]
        events = self.events.enabled
        gone: list[tuple[int, bytes, int]] | None
        if self._k_evict is not None:  # the kernel also adds the keys to the C ghost record
            gone, num_keys, num_blocks = self._k_evict(
                self._table, blocks, group_id, ref_count, self.ghost, events
            )
        else:
            gone, num_blocks = self._unkey(blocks, group_id, ref_count)
            self.ghost.add_many(gone)
            num_keys = len(gone)
        if not num_blocks:
            return
        if events and gone is not None:
            removed, page = self.events.removed, self._full_page
            for gid, key, bd in gone:
                removed(gid, key, bd, entry_kind(page[gid], bd))
        if victims:  # after the removals: a consumer sees a key leave the device, then land
            assert self.on_evict is not None
            self.on_evict(victims)
        self.num_removed_keys += num_keys
        self.num_evicted_blocks += num_blocks

    def _unkey(
        self, blocks: Iterable[int], group_id: int, ref_count: int
    ) -> tuple[list[tuple[int, bytes, int]], int]:
        """`_evict_keys`' loop (the `evict_keys` kernel's contract, which also adds the rows to
        the C ghost record): in block order, every key of a block leaves the group's index,
        its lower keys first (ascending), as (group, key, boundary) rows; then each block gets
        `group_id` and `ref_count`. Returns the rows and the number of blocks that had keys."""
        key1, b1, group, index, more_of = self._key1, self._b1, self.group, self.index, self._more
        ref = self.ref
        gone: list[tuple[int, bytes, int]] = []
        num_blocks = 0
        for b in blocks:
            key = key1[b]
            if key is not None:
                gid = group[b]
                idx = index[gid]
                if more_of and b in more_of:  # the lower keys of a large page, ascending
                    for bd, k in more_of.pop(b):
                        del idx[k]
                        gone.append((gid, k, bd))
                del idx[key]
                gone.append((gid, key, b1[b]))
                key1[b] = None
                num_blocks += 1
            ref[b] = ref_count
            group[b] = group_id
        return gone, num_blocks

    def clear_keys(self) -> None:
        """`reset()`: drop every key and the ghost record, recording AllBlocksCleared; the
        queue order is untouched."""
        for idx in self.index:
            idx.clear()
        self.ghost.clear()
        for b in range(1, self.num_blocks):
            if self._key1[b] is not None:
                self._key1[b] = None
                if self.ref[b] == 0:
                    self.group[b] = -1
        self._more.clear()
        if self.events.enabled:
            self.events.cleared()

    # ------------------------------------------------------------------ gauges
    @property
    def num_free(self) -> int:
        return len(self.policy)

    def in_ghost(self, group_id: int, key: bytes) -> bool:
        return self.ghost.contains(group_id, key)
