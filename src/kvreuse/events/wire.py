"""The KV-event wire format that vLLM 0.33.0 publishes, as msgspec structs.

A payload is the msgpack of one batch, a positional array `[timestamp, events,
data_parallel_rank]`. In the default format each event is a map tagged by its `"type"` key
with vLLM's field names; fields left at their default are omitted. The legacy format sends each
event as a positional array whose first element is the tag (what consumers written before
vLLM moved to maps read). Hashes are unsigned 64-bit ints: the low 64 bits of a digest read
big-endian, which is what vLLM sends when it publishes int hashes (its default).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import msgspec

MEDIUM_GPU = "GPU"

_MASK64 = (1 << 64) - 1


def hash64(digest: bytes) -> int:
    """The low 64 bits of `digest` read as a big-endian unsigned integer."""
    return int.from_bytes(digest[-8:], "big") & _MASK64


def low64(digests: Sequence[bytes]) -> list[int]:
    """`[hash64(d) for d in digests]`, for digests of one length, in one C-level unpack of the
    joined digests rather than one Python call per digest."""
    n = len(digests)
    if n < 4:
        return [int.from_bytes(d[-8:], "big") for d in digests]
    joined = b"".join(digests)
    size = len(joined) // n
    if size < 8 or size * n != len(joined):  # mixed lengths: not a chain's digests
        return [hash64(d) for d in digests]
    skip = f"{size - 8}x" if size > 8 else ""
    return list(struct.unpack(">" + f"{skip}Q" * n, joined))


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


def stored_run(
    hashes: list[int],
    parent: int | None,
    tokens: list[int],
    unit: int,
    gid: int,
    spec: tuple[str, int | None],
    lora_name: str | None,
    extra_keys: list[tuple[Any, ...] | None] | None,
    lookahead: list[list[int]] | None,
) -> BlockStored:
    """The stored event of a run of `len(hashes)` consecutive units of group `gid`.

    Every event mode builds its stored events here, so they fill the same fields: `spec` is
    the group's (KVCacheSpecKind, sliding window), `tokens` the run's tokens (`unit` per
    hash), `extra_keys` and `lookahead` one entry per hash or None.
    """
    kind, window = spec
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=unit,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=lora_name,
        extra_keys=extra_keys,
        group_idx=gid,
        kv_cache_spec_kind=kind,
        kv_cache_spec_sliding_window=window,
        lookahead_token_ids=lookahead,
    )


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


# The legacy positional format: the tag first, then the fields every consumer knows.
class LegacyBlockStored(
    msgspec.Struct, tag="BlockStored", array_like=True, omit_defaults=True, gc=False
):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


class LegacyBlockRemoved(
    msgspec.Struct, tag="BlockRemoved", array_like=True, omit_defaults=True, gc=False
):
    block_hashes: list[int]
    medium: str | None = None


class LegacyAllBlocksCleared(
    msgspec.Struct, tag="AllBlocksCleared", array_like=True, omit_defaults=True, gc=False
):
    pass


LegacyEvent = LegacyBlockStored | LegacyBlockRemoved | LegacyAllBlocksCleared


class LegacyEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[LegacyEvent]
    data_parallel_rank: int | None = None


def to_legacy(event: WireEvent) -> LegacyEvent:
    """The positional form of a map event (the fields older consumers read)."""
    if isinstance(event, BlockStored):
        return LegacyBlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        )
    if isinstance(event, BlockRemoved):
        return LegacyBlockRemoved(event.block_hashes, event.medium)
    return LegacyAllBlocksCleared()


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(EventBatch)
_LEGACY_DECODER = msgspec.msgpack.Decoder(LegacyEventBatch)


def encode_batch(batch: EventBatch | LegacyEventBatch) -> bytes:
    return _ENCODER.encode(batch)


class PayloadError(ValueError):
    """A payload that is not a KV event batch in either format."""


def decode_batch(payload: bytes) -> EventBatch:
    """A batch in the map format, or in the legacy format (converted to the map structs)."""
    try:
        return _DECODER.decode(payload)
    except RecursionError:  # nesting past the interpreter's stack (extra keys are free-form)
        raise PayloadError("not a KV event batch: nested too deeply") from None
    except msgspec.DecodeError as map_error:
        try:
            legacy = _LEGACY_DECODER.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            raise PayloadError(f"not a KV event batch: {map_error}") from None
    return EventBatch(
        legacy.ts, [_from_legacy(e) for e in legacy.events], legacy.data_parallel_rank
    )


def _from_legacy(event: LegacyEvent) -> WireEvent:
    if isinstance(event, LegacyBlockStored):
        return BlockStored(
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
            None,
        )
    if isinstance(event, LegacyBlockRemoved):
        return BlockRemoved(event.block_hashes, event.medium)
    return AllBlocksCleared()
