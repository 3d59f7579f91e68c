"""KV events (spec §13): what a router or an offload tier needs to mirror the index.

Events are recorded as compact tuples at emission and turned into objects by `take_events()`, so
a manager whose consumer drains rarely pays little on the hot path. A stored-run record keeps a
reference to the publishing request's token list and chain; both are append-only, so building
the event later reads exactly what was true at emission.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from kvreuse.core.hashing.chain import CborChain
from kvreuse.core.hashing.keys import unit_extra_keys
from kvreuse.core.kinds import EntryKind, entry_kind

if TYPE_CHECKING:
    from kvreuse.core.config import Geometry
    from kvreuse.core.request import RequestState


class StoredEntry(NamedTuple):
    """One published entry. A named tuple, not a frozen dataclass: a run holds one per hash
    unit, and a tuple is built in under half the time."""

    hash: bytes
    boundary: int
    kind: EntryKind


@dataclass(frozen=True, slots=True)
class BlockStored:
    """One maximal run of consecutive entries published for one request and one group."""

    seq: int
    group_id: int
    group_kind: str
    hash_unit: int
    lookahead_tokens: int
    block_size: int
    entries: tuple[StoredEntry, ...]
    token_start: int
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    successor_token_ids: tuple[tuple[int, ...], ...]
    extra_keys: tuple[tuple[Any, ...], ...]
    lora: tuple[str, str] | None
    # H[token_start/u], …, H[last/u]: the chain over the run's span, so that a consumer names
    # the parent of any entry (H[b/u − 1]) without remembering earlier runs
    unit_hashes: tuple[bytes, ...] = ()
    # the request's cache salt, only under hash_algo "sha256_cbor" (None otherwise): vLLM's
    # events name it among block 1's extra keys, and that mode sends what vLLM sends
    cache_salt: str | None = None
    type: Literal["BlockStored"] = "BlockStored"


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    seq: int
    group_id: int
    hash: bytes
    boundary: int
    kind: EntryKind
    cause: str = "evicted"
    type: Literal["BlockRemoved"] = "BlockRemoved"


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    seq: int
    type: Literal["AllBlocksCleared"] = "AllBlocksCleared"


@dataclass(frozen=True, slots=True)
class TierStored:
    """Keys a tier below the pool now holds (kvreuse.core.tiers): a block's, as it was demoted
    or moved down. `entries` are (boundary, key), ascending; `medium` is the tier's."""

    seq: int
    tier: int
    medium: str
    group_id: int
    entries: tuple[tuple[int, bytes], ...]
    type: Literal["TierStored"] = "TierStored"


@dataclass(frozen=True, slots=True)
class TierRemoved:
    """Keys a tier no longer holds (its slot was moved further down or dropped)."""

    seq: int
    tier: int
    medium: str
    group_id: int
    entries: tuple[tuple[int, bytes], ...]
    type: Literal["TierRemoved"] = "TierRemoved"


Event = BlockStored | BlockRemoved | AllBlocksCleared | TierStored | TierRemoved


class EventLog:
    """Bounded queue of pending events with a gap-revealing sequence number."""

    __slots__ = ("dropped", "enabled", "max_pending", "pending", "seq")

    def __init__(self, enabled: bool, max_pending: int | None) -> None:
        self.enabled = enabled
        self.max_pending = max_pending
        self.pending: deque[tuple[Any, ...]] = deque()
        self.seq = 0
        self.dropped = 0

    def set_enabled(self, enabled: bool) -> None:
        """Start or stop recording (a server records only while it publishes); stopping drops
        what is pending, so a log nobody reads holds nothing."""
        self.enabled = enabled
        if not enabled:
            self.pending.clear()

    def _push(self, record: tuple[Any, ...]) -> None:
        if self.max_pending is not None and len(self.pending) >= self.max_pending:
            if self.max_pending == 0:
                self.dropped += 1
                return
            self.pending.popleft()
            self.dropped += 1
        self.pending.append(record)

    def stored(self, req: RequestState, group_id: int, boundaries: list[int]) -> None:
        """One BlockStored for one run (see `stored_runs`) that `req` published."""
        self.seq += 1
        self._push(("S", self.seq, req, group_id, boundaries))

    def removed(self, group_id: int, key: bytes, boundary: int, kind: EntryKind) -> None:
        self.seq += 1
        self._push(("R", self.seq, group_id, key, boundary, kind))

    def cleared(self) -> None:
        self.seq += 1
        self._push(("C", self.seq))

    def tier_stored(
        self, tier: int, medium: str, group_id: int, keys: list[tuple[int, bytes]]
    ) -> None:
        self._tier("TS", tier, medium, group_id, keys)

    def tier_removed(
        self, tier: int, medium: str, group_id: int, keys: list[tuple[int, bytes]]
    ) -> None:
        self._tier("TR", tier, medium, group_id, keys)

    def _tier(
        self, tag: str, tier: int, medium: str, group_id: int, keys: list[tuple[int, bytes]]
    ) -> None:
        self.seq += 1
        self._push((tag, self.seq, tier, medium, group_id, tuple(keys)))

    def take(self, geo: Geometry) -> list[Event]:
        out = [_build(geo, r) for r in self.pending]
        self.pending.clear()
        return out


def stored_runs(boundaries: list[int], hash_unit: int, state_page: int) -> list[list[int]]:
    """The runs of one publication that each get one BlockStored (ascending boundaries).

    A BlockStored carries the tokens from its run's first page to its last boundary, so a run
    is a maximal sequence of entries whose tokens join up. Attention entries (`state_page` 0)
    join when they are one hash unit apart: a skipped duplicate or NULL page ends a run.
    Recurrent states join when a state's page of `state_page` tokens starts at the previous
    state.
    """
    n = len(boundaries)
    if n == 1 or (not state_page and boundaries[-1] - boundaries[0] == (n - 1) * hash_unit):
        # Ascending multiples of the unit span (n - 1) units only if no unit is skipped: the
        # whole publication of a commit is usually one run, found without a pass.
        return [boundaries[:]]
    runs: list[list[int]] = []
    start = 0
    prev = boundaries[0]
    for i in range(1, len(boundaries)):
        b = boundaries[i]
        joined = (b - 1) // state_page * state_page == prev if state_page else b - prev == hash_unit
        if not joined:
            runs.append(boundaries[start:i])
            start = i
        prev = b
    runs.append(boundaries[start:])
    return runs


def _build(geo: Geometry, r: tuple[Any, ...]) -> Event:
    if r[0] == "R":
        return BlockRemoved(seq=r[1], group_id=r[2], hash=r[3], boundary=r[4], kind=r[5])
    if r[0] == "C":
        return AllBlocksCleared(seq=r[1])
    if r[0] == "TS":
        return TierStored(seq=r[1], tier=r[2], medium=r[3], group_id=r[4], entries=r[5])
    if r[0] == "TR":
        return TierRemoved(seq=r[1], tier=r[2], medium=r[3], group_id=r[4], entries=r[5])
    _, seq, req, gid, boundaries = r
    g = geo.groups[gid]
    u, lookahead, page = geo.hash_unit, geo.lookahead, g.page_size
    hashes = req.chain.hashes
    kind_page = g.entry_page  # entry_kind's page: 0 for states
    entries = tuple(StoredEntry(hashes[b // u], b, entry_kind(kind_page, b)) for b in boundaries)
    start = (boundaries[0] - 1) // page * page
    last = boundaries[-1]
    tokens = req.tokens
    units = range(start // u + 1, last // u + 1)
    if req.mm_items:
        extra = tuple(
            tuple(
                key
                for key in unit_extra_keys(k, u, lookahead, req.lora, req.mm_items, None)
                if key[0] == "mm"
            )
            for k in units
        )
    else:  # the common case: no multimodal item, so every unit's mm keys are empty
        extra = ((),) * len(units)
    return BlockStored(
        seq=seq,
        group_id=gid,
        group_kind=g.kind,
        hash_unit=u,
        lookahead_tokens=lookahead,
        block_size=page,
        entries=entries,
        token_start=start,
        parent_hash=hashes[start // u] if start else None,
        token_ids=tuple(tokens[start:last]),
        successor_token_ids=(
            tuple(tuple(tokens[b : b + lookahead]) for b in boundaries)
            if lookahead
            else ((),) * len(boundaries)
        ),
        extra_keys=extra,
        lora=req.lora,
        unit_hashes=tuple(hashes[start // u : last // u + 1]),
        cache_salt=req.chain.cache_salt if isinstance(req.chain, CborChain) else None,
    )
