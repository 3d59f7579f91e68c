"""From the core's events (`KVCacheManager.take_events()`) to vLLM wire events.

On the wire a block is one hash unit: `block_size` is the unit `u` of the published chain,
never the physical page (a DCP page is `block_size × dcp` tokens, which a router would hash at
the wrong granularity), and each event's `token_ids` hold exactly `u` tokens per hash in
`block_hashes`, after the block named by `parent_block_hash`. A core `BlockStored` run is split
into unit-contiguous pieces, one wire event each (recurrent states saved a page apart are
separate blocks on the wire).

A core run carries the tokens and the parent hash from the start of its first page. When the
run starts inside that page (an earlier commit already published the page's first units), the
hash of the unit just before it is not in the event; the converter remembers, in two bounded
maps, the hashes it published for units inside a page (keyed by page, tokens and extras) and
every child → parent link it published (a recurrent state shares its hash with the attention
entry at the same boundary). A parent found in neither is sent as None and counted in
`unknown_parents`. The cache salt never leaves the process: a salted chain is visible only
through its hashes, so two requests with the same first-page tokens and different salts can
share a memo key; only the parent link of a later piece can then be wrong, never a hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from kvreuse.core import AllBlocksCleared as CoreCleared
from kvreuse.core import BlockRemoved as CoreRemoved
from kvreuse.core import BlockStored as CoreStored
from kvreuse.core import Event, Geometry, GroupGeometry
from kvreuse.events.wire import (
    MEDIUM_GPU,
    SPEC_KINDS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireEvent,
    hash64,
)

Mode = Literal["groups", "routable", "legacy"]
MODES: tuple[str, ...] = ("groups", "routable", "legacy")
MEMO_CAPACITY = 1 << 16


def attention_group(geo: Geometry) -> GroupGeometry:
    """The group a router that reads one group indexes: the first full-attention target."""
    for g in geo.cacheable:
        if g.kind == "full" and not g.is_draft:
            return g
    raise ValueError("the geometry has no prefix-cacheable full-attention target group")


def _bounded_put(memo: dict[Any, Any], key: Any, value: Any) -> None:
    if key not in memo and len(memo) >= MEMO_CAPACITY:
        del memo[next(iter(memo))]  # dicts keep insertion order: the oldest goes first
    memo[key] = value


def _digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(array("I", tokens).tobytes(), digest_size=16).digest()


class Converter:
    """Turns core events into wire events for the groups `groups` selects (all by default)."""

    def __init__(self, geo: Geometry, groups: Iterable[int] | None = None) -> None:
        self.geo = geo
        cacheable = {g.group_id for g in geo.cacheable}
        self.group_ids = cacheable if groups is None else set(groups) & cacheable
        self.unknown_parents = 0
        self._inside: dict[tuple[Any, ...], int] = {}  # (gid, page start, parent, tokens) → hash
        self._links: dict[int, int | None] = {}  # child hash → parent hash
        # only recurrent runs start where neither the run nor a page tells the parent
        self._track_links = bool(geo.recurrent)

    def convert(self, events: Iterable[Event]) -> list[WireEvent]:
        out: list[WireEvent] = []
        for ev in events:
            if isinstance(ev, CoreStored):
                if ev.group_id in self.group_ids:
                    out.extend(self.stored(ev))
            elif isinstance(ev, CoreRemoved):
                if ev.group_id in self.group_ids:
                    self.removed(out, ev.group_id, hash64(ev.hash))
            elif isinstance(ev, CoreCleared):
                self._inside.clear()
                self._links.clear()
                out.append(AllBlocksCleared())
        return out

    @staticmethod
    def removed(out: list[WireEvent], gid: int, key: int) -> None:
        """Appends a removal; consecutive removals in one group share one event."""
        last = out[-1] if out else None
        if isinstance(last, BlockRemoved) and last.group_idx == gid:
            last.block_hashes.append(key)
        else:
            out.append(BlockRemoved([key], MEDIUM_GPU, group_idx=gid))

    def stored(self, ev: CoreStored) -> list[WireEvent]:
        """One wire event per unit-contiguous piece of the run `ev`."""
        u = ev.hash_unit
        entries = ev.entries
        n = len(entries)
        if entries[-1].boundary - entries[0].boundary == (n - 1) * u:
            out: list[WireEvent] = [self._piece(ev, 0, n)]  # the usual case: one piece
        else:
            out = []
            i = 0
            while i < n:
                j = i + 1
                while j < n and entries[j].boundary - entries[j - 1].boundary == u:
                    j += 1
                out.append(self._piece(ev, i, j))
                i = j
        if ev.block_size != u:  # only pages of several units have units inside a page
            self._remember(ev)
        return out

    def _parent(self, ev: CoreStored, first: int, first_hash: int) -> int | None:
        u, start = ev.hash_unit, ev.token_start
        p = first - u
        if p == 0:
            return None
        if p == start:
            return hash64(ev.parent_hash) if ev.parent_hash is not None else None
        if first_hash in self._links:
            return self._links[first_hash]
        key = self._inside_key(ev, p, self._successors(ev, p), ev.parent_hash)
        if key in self._inside:
            return self._inside[key]
        self.unknown_parents += 1
        return None

    @staticmethod
    def _successors(ev: CoreStored, boundary: int) -> tuple[int, ...]:
        at = boundary - ev.token_start
        return tuple(ev.token_ids[at : at + ev.lookahead_tokens])

    def _inside_key(
        self, ev: CoreStored, boundary: int, successors: tuple[int, ...], page_parent: Any
    ) -> tuple[Any, ...]:
        """What determines the hash at `boundary` given the hash at the start of its page."""
        page_start = (boundary - 1) // ev.block_size * ev.block_size
        at = page_start - ev.token_start
        digest = _digest(ev.token_ids[at : boundary - ev.token_start])
        return self._key(ev, page_start, page_parent, digest, boundary, successors)

    def _key(
        self,
        ev: CoreStored,
        page_start: int,
        page_parent: Any,
        digest: bytes,
        boundary: int,
        successors: tuple[int, ...],
    ) -> tuple[Any, ...]:
        extra = self._extra(ev, boundary // ev.hash_unit)
        return (ev.group_id, page_start, page_parent, ev.lora, digest, successors, extra)

    @staticmethod
    def _extra(ev: CoreStored, unit: int) -> tuple[Any, ...]:
        index = unit - ev.token_start // ev.hash_unit - 1
        return ev.extra_keys[index] if 0 <= index < len(ev.extra_keys) else ()

    def _remember(self, ev: CoreStored) -> None:
        """Memorise the hash of every unit inside its page, under `_key`'s key; the digests of
        the page's tokens are built incrementally, one unit at a time (this runs per entry)."""
        page, start, u = ev.block_size, ev.token_start, ev.hash_unit
        tokens = array("I", ev.token_ids)
        data, width = memoryview(tokens.tobytes()), tokens.itemsize
        gid, lora, extras = ev.group_id, ev.lora, ev.extra_keys
        first_unit = start // u + 1
        memo = self._inside
        page_parent = ev.parent_hash  # the hash at the start of the current entry's page
        page_start, fed = -1, 0
        running = hashlib.blake2b(digest_size=16)
        for e, successors in zip(ev.entries, ev.successor_token_ids, strict=True):
            b = e.boundary
            ps = (b - 1) // page * page
            if ps != page_start:
                page_start, fed = ps, ps
                running = hashlib.blake2b(digest_size=16)
            running.update(data[(fed - start) * width : (b - start) * width])
            fed = b
            if b % page:  # a unit inside its page: a later run may start after it
                extra = extras[b // u - first_unit]
                key = (gid, ps, page_parent, lora, running.copy().digest(), successors, extra)
                if len(memo) >= MEMO_CAPACITY and key not in memo:
                    del memo[next(iter(memo))]  # the oldest goes first
                memo[key] = int.from_bytes(e.hash[-8:], "big")
            else:
                page_parent = e.hash

    def _piece(self, ev: CoreStored, i: int, j: int) -> BlockStored:
        u, start = ev.hash_unit, ev.token_start
        entries = ev.entries[i:j]
        hashes = [int.from_bytes(e.hash[-8:], "big") for e in entries]
        first, last = entries[0].boundary, entries[-1].boundary
        parent = self._parent(ev, first, hashes[0])
        if self._track_links:
            links = self._links
            prev = parent
            for h in hashes:
                _bounded_put(links, h, prev)
                prev = h
        g = self.geo.groups[ev.group_id]
        lora_name = ev.lora[0] if ev.lora else None
        extra: list[tuple[Any, ...] | None] | None = None
        if lora_name is not None or any(ev.extra_keys):
            extra = []
            for e in entries:
                mm = [k[1:] for k in self._extra(ev, e.boundary // u) if k and k[0] == "mm"]
                keys: tuple[Any, ...] = ((lora_name,) if lora_name else ()) + tuple(mm)
                extra.append(keys or None)
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=list(ev.token_ids[first - u - start : last - start]),
            block_size=u,
            lora_id=None,
            medium=MEDIUM_GPU,
            lora_name=lora_name,
            extra_keys=extra,
            group_idx=ev.group_id,
            kv_cache_spec_kind=SPEC_KINDS[g.kind],
            kv_cache_spec_sliding_window=g.window,
            lookahead_token_ids=(
                [list(ev.successor_token_ids[k]) for k in range(i, j)]
                if ev.lookahead_tokens
                else None
            ),
        )
