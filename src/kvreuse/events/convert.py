"""From the core's events (`KVCacheManager.take_events()`) to vLLM wire events.

On the wire a block is one hash unit: `block_size` is the unit `u` of the published chain,
never the physical page (a DCP page is `block_size × dcp` tokens, which a router would hash at
the wrong granularity), and each event's `token_ids` hold exactly `u` tokens per hash in
`block_hashes`, after the block named by `parent_block_hash`. A core `BlockStored` run is split
into unit-contiguous pieces, one wire event each (recurrent states saved a page apart are
separate blocks on the wire). The parent of each piece is the chain hash of the unit before
it, which the core's event carries (`unit_hashes`, the chain over the run's span), so no piece
is ever sent without its parent and nothing is remembered between events. The cache salt leaves
the process only under hash_algo "sha256_cbor", where the events are vLLM's own and vLLM names
the salt among block 1's extra keys; otherwise a salted chain is visible only through its hashes
(docs/decisions.md).

The work per event is a few slices and one C-level conversion of the hashes (`low64`): no
Python object per unit but the ints msgpack needs.

A tier's keys (`TierStored` / `TierRemoved`, kvreuse.core.tiers) go out as vLLM's offloading
connector sends its own: a `BlockStored` or `BlockRemoved` whose `medium` is the tier's ("CPU"
for host memory), with the hashes only, no tokens and no parent (the device's events named the
chain before the block was demoted). A converter made with `tiers=False` leaves them out, for
consumers that read no `medium` and would take a host copy for a device block.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvreuse.core import AllBlocksCleared as CoreCleared
from kvreuse.core import BlockRemoved as CoreRemoved
from kvreuse.core import BlockStored as CoreStored
from kvreuse.core import Event, Geometry, GroupGeometry, TierRemoved, TierStored
from kvreuse.core.spi import Stage
from kvreuse.events.wire import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireEvent,
    hash64,
    low64,
    stored_run,
)


def block_extra_keys(
    ev: CoreStored, boundaries: Sequence[int], vllm: bool
) -> list[tuple[Any, ...] | None] | None:
    """vLLM's untagged per-block extra keys, `(lora_name, (mm_identifier, offset)…, salt)`, for
    the blocks of `ev` ending at `boundaries`. The salt is there only under sha256_cbor (`vllm`,
    where `ev.cache_salt` is set): then the list is vLLM's to the letter, one entry per block,
    None for a block without keys. Otherwise a run without LoRA and multimodal items (the
    common case, decided without a pass) sends None for the whole list."""
    lora_name = ev.lora[0] if ev.lora else None
    salt = ev.cache_salt
    if not vllm and lora_name is None and not any(ev.extra_keys):
        return None
    u, head = ev.hash_unit, (lora_name,) if lora_name else ()
    base, n = ev.token_start // u + 1, len(ev.extra_keys)
    out: list[tuple[Any, ...] | None] = []
    for b in boundaries:
        at = b // u - base
        mm = tuple(k[1:] for k in (ev.extra_keys[at] if 0 <= at < n else ()) if k[0] == "mm")
        tail = (salt,) if salt and b == u else ()
        out.append((head + mm + tail) or None)
    return out


def attention_group(geo: Geometry) -> GroupGeometry:
    """The group a router that reads one group indexes: the first full-attention target."""
    for g in geo.cacheable:
        if g.stage is Stage.FULL and not g.is_draft:
            return g
    raise ValueError("the geometry has no prefix-cacheable full-attention target group")


class Converter:
    """Turns core events into wire events for the groups `groups` selects (all by default),
    the tiers' too unless `tiers` is False (a consumer that reads no `medium`)."""

    def __init__(
        self, geo: Geometry, groups: Iterable[int] | None = None, *, tiers: bool = True
    ) -> None:
        self.geo = geo
        self.tiers = tiers
        cacheable = {g.group_id for g in geo.cacheable}
        self.group_ids = cacheable if groups is None else set(groups) & cacheable
        # per group: (kv_cache_spec_kind, kv_cache_spec_sliding_window), looked up per event;
        # the kind names itself in vLLM's words (kvreuse.core.kinds)
        self._spec = {g.group_id: (g.wire_kind, g.window) for g in geo.groups}

    def convert(self, events: Iterable[Event]) -> list[WireEvent]:
        out: list[WireEvent] = []
        for ev in events:
            if isinstance(ev, CoreStored):
                if ev.group_id in self.group_ids:
                    self.stored(out, ev)
            elif isinstance(ev, CoreRemoved):
                if ev.group_id in self.group_ids:
                    self.removed(out, ev.group_id, hash64(ev.hash))
            elif isinstance(ev, CoreCleared):
                out.append(AllBlocksCleared())
            elif (
                isinstance(ev, TierStored | TierRemoved)
                and self.tiers
                and ev.group_id in self.group_ids
            ):
                self.tier(out, ev)
        return out

    @staticmethod
    def removed(out: list[WireEvent], gid: int, key: int, medium: str = MEDIUM_GPU) -> None:
        """Appends a removal; consecutive removals in one group and medium share one event."""
        last = out[-1] if out else None
        if isinstance(last, BlockRemoved) and last.group_idx == gid and last.medium == medium:
            last.block_hashes.append(key)
        else:
            out.append(BlockRemoved([key], medium, group_idx=gid))

    def tier(self, out: list[WireEvent], ev: TierStored | TierRemoved) -> None:
        """A tier's keys, as vLLM's offloading connector sends its own: the hashes and the
        medium, no tokens and no parent (the device's events named the chain before)."""
        keys = low64([k for _, k in ev.entries])
        if isinstance(ev, TierRemoved):
            for key in keys:
                self.removed(out, ev.group_id, key, ev.medium)
            return
        kind, window = self._spec[ev.group_id]
        out.append(
            BlockStored(
                block_hashes=keys,
                parent_block_hash=None,
                token_ids=[],
                block_size=self.geo.hash_unit,
                lora_id=None,
                medium=ev.medium,
                lora_name=None,
                group_idx=ev.group_id,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=window,
            )
        )

    def stored(self, out: list[WireEvent], ev: CoreStored) -> None:
        """Appends one wire event per unit-contiguous piece of the run `ev`."""
        u = ev.hash_unit
        entries = ev.entries
        n = len(entries)
        if entries[-1].boundary - entries[0].boundary == (n - 1) * u:
            out.append(self._piece(ev, 0, n))  # the usual case: one piece
            return
        i = 0
        while i < n:
            j = i + 1
            while j < n and entries[j].boundary - entries[j - 1].boundary == u:
                j += 1
            out.append(self._piece(ev, i, j))
            i = j

    def _extra_keys(self, ev: CoreStored, i: int, j: int) -> list[tuple[Any, ...] | None] | None:
        return block_extra_keys(ev, [e.boundary for e in ev.entries[i:j]], self.geo.vllm_hashes)

    def _piece(self, ev: CoreStored, i: int, j: int) -> BlockStored:
        u, start = ev.hash_unit, ev.token_start
        first, last = ev.entries[i].boundary, ev.entries[j - 1].boundary
        at = (first - start) // u  # unit_hashes[at] is the hash at `first`
        chain = ev.unit_hashes
        parent = None if first == u else int.from_bytes(chain[at - 1][-8:], "big")
        lookahead = ev.successor_token_ids
        return stored_run(
            low64(chain[at : at + j - i]),
            parent,
            list(ev.token_ids[first - u - start : last - start]),
            u,
            ev.group_id,
            self._spec[ev.group_id],
            ev.lora[0] if ev.lora else None,
            self._extra_keys(ev, i, j),
            [list(lookahead[k]) for k in range(i, j)] if ev.lookahead_tokens else None,
        )
