"""The bytes of the memory tiers below the paged cache, moved as the core's plans say.

The core decides (kvreuse.core.tiers) and hands each step its `tier_ops`; the runner carries
them out here, in order, before the step's copies and forward:

    Demote(tier, slot, group, block)   cache block  ──► tier slot
    Move(src_tier, src_slot, dst…)     tier slot    ──► tier slot
    Load(tier, slot, group, block)     tier slot    ──► cache block

`HostTier` keeps a slot as tensors (host memory: a copy, not a view of the cache). `BytesTier`
keeps it as bytes with a frame (a magic, the length, a SHA-256 of the payload) in a byte store
with `get`/`set`, in-process by default, so a value that is truncated or altered reads as
`TierCorruption` and is never loaded into the cache.
"""

from __future__ import annotations

import hashlib
import io
import struct
from collections import Counter
from collections.abc import MutableMapping, Sequence

import torch
from torch import Tensor

from kvreuse.core import DEVICE_MEDIUM, Demote, Load, Move, TierOp
from kvreuse.engine.paged import PagedCache

Block = dict[str, Tensor]  # per layer: what `PagedCache.read_block` returns
MAGIC = b"KVRT"
_HEAD = struct.Struct(">4sQ32s")  # magic, payload length, sha256(payload)


class TierCorruption(RuntimeError):
    """A tier slot's bytes are not what was stored: the load is refused."""


class HostTier:
    def __init__(self) -> None:
        self.slots: dict[int, Block] = {}

    def put(self, slot: int, block: Block) -> None:
        self.slots[slot] = {layer: t.clone() for layer, t in block.items()}

    def get(self, slot: int) -> Block:
        if slot not in self.slots:
            raise TierCorruption(f"host tier slot {slot} holds nothing")
        return self.slots[slot]


class BytesTier:
    """A tier kept as framed bytes in `store` (key: the slot number), e.g. a shared store."""

    def __init__(
        self, store: MutableMapping[str, bytes] | None = None, name: str = "store"
    ) -> None:
        self.store: MutableMapping[str, bytes] = {} if store is None else store
        self.name = name
        self.prefix = ""  # the namespace in `store` (`bind`)

    def bind(self, namespace: str) -> None:
        """Keep this tier's values under `namespace` in the store (`LLM` binds each tier:
        kvreuse.engine.store)."""
        self.prefix = f"{namespace}:"

    def put(self, slot: int, block: Block) -> None:
        buf = io.BytesIO()
        torch.save({layer: t.contiguous() for layer, t in block.items()}, buf)
        payload = buf.getvalue()
        head = _HEAD.pack(MAGIC, len(payload), hashlib.sha256(payload).digest())
        self.store[f"{self.prefix}{slot}"] = head + payload

    def get(self, slot: int) -> Block:
        raw = self.store.get(f"{self.prefix}{slot}")
        if raw is None or len(raw) < _HEAD.size:
            raise TierCorruption(f"{self.name} tier slot {slot}: no value or a truncated one")
        magic, length, digest = _HEAD.unpack_from(raw)
        payload = raw[_HEAD.size :]
        if magic != MAGIC or length != len(payload) or hashlib.sha256(payload).digest() != digest:
            raise TierCorruption(f"{self.name} tier slot {slot}: its bytes fail their checksum")
        block: Block = torch.load(io.BytesIO(payload), weights_only=True)
        return block


TierBytes = HostTier | BytesTier


class Transfers:
    """Bytes and blocks moved between the cache and its tiers, per direction, named as vLLM's
    offloading metrics name it (`transfer_type`: "GPU_to_CPU", "CPU_to_GPU", …; the cache is
    "GPU" whatever device it is on, as in KV events)."""

    def __init__(self, media: Sequence[str]) -> None:
        self.media = list(media)  # per tier, its medium
        self.bytes: Counter[str] = Counter()
        self.blocks: Counter[str] = Counter()

    def add(self, src: str, dst: str, block: Block) -> None:
        way = f"{src}_to_{dst}"
        self.bytes[way] += sum(t.numel() * t.element_size() for t in block.values())
        self.blocks[way] += 1


def run_tier_ops(
    ops: Sequence[TierOp],
    tiers: Sequence[TierBytes],
    cache: PagedCache,
    moved: Transfers | None = None,
) -> None:
    """Carry out a step's tier ops in their order (counting what moves in `moved`)."""
    media = moved.media if moved is not None else [""] * len(tiers)
    for op in ops:
        if isinstance(op, Demote):
            block = cache.read_block(op.group_id, op.block_id)
            tiers[op.tier].put(op.slot, block)
            way = (DEVICE_MEDIUM, media[op.tier])
        elif isinstance(op, Move):
            block = tiers[op.src_tier].get(op.src_slot)
            tiers[op.dst_tier].put(op.dst_slot, block)
            way = (media[op.src_tier], media[op.dst_tier])
        elif isinstance(op, Load):
            block = tiers[op.tier].get(op.slot)
            cache.write_block(op.group_id, op.block_id, block)
            way = (media[op.tier], DEVICE_MEDIUM)
        if moved is not None:
            moved.add(*way, block)
