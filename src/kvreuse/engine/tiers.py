"""The bytes of the memory tiers below the paged cache, moved as the core's plans say.

The core decides (kvreuse.core.tiers) and hands each step its `tier_ops`; the runner carries
them out here, in order, before the step's copies and forward:

    Demote(tier, slot, group, block)   cache block  ──► tier slot
    Move(src_tier, src_slot, dst…)     tier slot    ──► tier slot
    Load(tier, slot, group, block)     tier slot    ──► cache block

Every slot is kept with its identity, the group and the (boundary, key) pairs of the op that
wrote it, and a read names the identity it expects (the op's keys): bytes another block's,
absent or altered are a *miss*, never loaded. `HostTier` keeps tensors (host memory: a copy, not
a view of the cache). `BytesTier` keeps framed bytes in a byte store with `get`/`set` (a dict
by default, a Redis server for a shared store):

    "KVR2" | len(identity) u32 | identity | payload (torch.save) | HMAC-SHA256(key, all before)

The tag's key is the tier's (`bind`: derived from the model's identity, not kept in the store),
so a value edited with its checksum recomputed, copied from another slot or another namespace,
or cut short fails it. `run_tier_ops` never raises for a miss: it returns the `TierFaults`, which
the core turns into misses (`KVCacheManager.tier_faults`): the slot is forgotten, a request whose
load failed computes its prefix again.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import struct
from collections import Counter
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvreuse.core import Demote, Move, TierOp
from kvreuse.core.spi import DEVICE_MEDIUM
from kvreuse.engine.paged import PagedCache

log = logging.getLogger("kvreuse.engine")

Block = dict[str, Tensor]  # per layer: what `PagedCache.read_block` returns
Keys = tuple[tuple[int, bytes], ...]
MAGIC = b"KVR2"
_LEN = struct.Struct(">I")
_KEY = struct.Struct(">qB")  # boundary, key length
_TAG = 32


class TierMiss(Exception):
    """A slot's bytes are not the ones a read expects (absent, another block's, altered, or
    the store cannot be reached): the read is a miss. `reason` names which."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def identity(group_id: int, keys: Keys) -> bytes:
    """The bytes naming one slot's content: its group and every (boundary, key) it carries."""
    parts = [struct.pack(">iI", group_id, len(keys))]
    for boundary, key in keys:
        parts.append(_KEY.pack(boundary, len(key)) + key)
    return b"".join(parts)


class HostTier:
    def __init__(self) -> None:
        self.slots: dict[int, tuple[bytes, Block]] = {}

    def put(self, slot: int, block: Block, ident: bytes = b"") -> None:
        self.slots[slot] = (ident, {layer: t.clone() for layer, t in block.items()})

    def get(self, slot: int, ident: bytes = b"") -> Block:
        held = self.slots.get(slot)
        if held is None:
            raise TierMiss("absent", f"host tier slot {slot} holds nothing")
        if held[0] != ident:
            raise TierMiss("identity", f"host tier slot {slot} holds another block")
        return held[1]


class BytesTier:
    """A tier kept as framed bytes in `store` (key: the slot number), e.g. a shared store."""

    def __init__(
        self, store: MutableMapping[str, bytes] | None = None, name: str = "store"
    ) -> None:
        self.store: MutableMapping[str, bytes] = {} if store is None else store
        self.name = name
        self.prefix = ""  # the namespace in `store` (`bind`)
        self.key = b""  # the tag's key (`bind`)

    def bind(self, namespace: str, key: bytes = b"") -> None:
        """Keep this tier's values under `namespace` in the store, tagged with `key` (`LLM`
        binds each tier: kvreuse.engine.store)."""
        self.prefix = f"{namespace}:"
        self.key = hashlib.sha256(b"kvreuse-tier-tag\0" + key + namespace.encode()).digest()

    def encode(self, block: Block, ident: bytes) -> bytes:
        buf = io.BytesIO()
        torch.save({layer: t.contiguous() for layer, t in block.items()}, buf)
        body = MAGIC + _LEN.pack(len(ident)) + ident + buf.getvalue()
        return body + hmac.digest(self.key, body, "sha256")

    def decode(self, raw: bytes | None, slot: int, ident: bytes) -> Block:
        where = f"{self.name} tier slot {slot}"
        if raw is None:
            raise TierMiss("absent", f"{where}: no value")
        head = len(MAGIC) + _LEN.size
        if len(raw) < head + _TAG or raw[: len(MAGIC)] != MAGIC:
            raise TierMiss("corrupt", f"{where}: not a framed block")
        body, tag = raw[:-_TAG], raw[-_TAG:]
        if not hmac.compare_digest(hmac.digest(self.key, body, "sha256"), tag):
            raise TierMiss("corrupt", f"{where}: its bytes fail their tag")
        (n,) = _LEN.unpack_from(raw, len(MAGIC))
        if raw[head : head + n] != ident:
            raise TierMiss("identity", f"{where}: holds another block's bytes")
        try:
            block: Block = torch.load(io.BytesIO(body[head + n :]), weights_only=True)
        except Exception as exc:  # a tagged payload that does not load: refused all the same
            raise TierMiss("corrupt", f"{where}: payload does not load ({exc})") from None
        return block

    def put(self, slot: int, block: Block, ident: bytes = b"") -> None:
        value = self.encode(block, ident)
        try:
            self.store[f"{self.prefix}{slot}"] = value
        except Exception as exc:  # any failure of the store behind: the slot has no bytes
            raise TierMiss("unavailable", f"{self.name} tier slot {slot}: {exc}") from None

    def get(self, slot: int, ident: bytes = b"") -> Block:
        try:
            raw = self.store.get(f"{self.prefix}{slot}")
        except Exception as exc:  # as in `put`: a miss, whatever the store raised
            raise TierMiss("unavailable", f"{self.name} tier slot {slot}: {exc}") from None
        return self.decode(raw, slot, ident)


TierBytes = HostTier | BytesTier


@dataclass
class TierFaults:
    """What a run of tier ops could not carry out: slots found without their bytes (tier,
    slot, group id, keys), device blocks a load did not fill, and the misses by reason."""

    slots: list[tuple[int, int, int, list[tuple[int, bytes]]]] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    reasons: Counter[str] = field(default_factory=Counter)

    def __bool__(self) -> bool:
        return bool(self.slots or self.blocks)

    def slot(self, t: int, slot: int, group_id: int, keys: Keys, why: TierMiss) -> None:
        self.slots.append((t, slot, group_id, list(keys)))
        self.reasons[why.reason] += 1


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
) -> TierFaults:
    """Carry out a step's tier ops in their order (counting what moves in `moved`); a miss
    skips its op and is returned, never raised."""
    media = moved.media if moved is not None else [""] * len(tiers)
    faults = TierFaults()
    for op in ops:
        try:
            block, way = _run(op, tiers, cache, media)
        except TierMiss as why:
            _fault(faults, op, why)
            continue
        if moved is not None:
            moved.add(*way, block)
    if faults:
        log.warning("tier ops: %d misses (%s)", len(faults.slots),
                    ", ".join(f"{n} {r}" for r, n in sorted(faults.reasons.items())))  # fmt: skip
    return faults


def _run(
    op: TierOp, tiers: Sequence[TierBytes], cache: PagedCache, media: Sequence[str]
) -> tuple[Block, tuple[str, str]]:
    if isinstance(op, Demote):
        block = cache.read_block(op.group_id, op.block_id)
        tiers[op.tier].put(op.slot, block, identity(op.group_id, op.keys))
        return block, (DEVICE_MEDIUM, media[op.tier])
    if isinstance(op, Move):
        ident = identity(op.group_id, op.keys)
        block = tiers[op.src_tier].get(op.src_slot, ident)
        try:
            tiers[op.dst_tier].put(op.dst_slot, block, ident)
        except TierMiss as why:
            raise _WriteMiss(why) from None
        return block, (media[op.src_tier], media[op.dst_tier])
    block = tiers[op.tier].get(op.slot, identity(op.group_id, op.keys))
    cache.write_block(op.group_id, op.block_id, block)
    return block, (media[op.tier], DEVICE_MEDIUM)


class _WriteMiss(TierMiss):
    """A move read its source but could not write its destination."""

    def __init__(self, why: TierMiss) -> None:
        super().__init__(why.reason, str(why))


def _fault(faults: TierFaults, op: TierOp, why: TierMiss) -> None:
    """Record which slots a failed op leaves without their bytes, and the block a failed load
    leaves unfilled."""
    if isinstance(op, Demote):
        faults.slot(op.tier, op.slot, op.group_id, op.keys, why)
    elif isinstance(op, Move):
        if not isinstance(why, _WriteMiss):  # the source itself is bad
            faults.slot(op.src_tier, op.src_slot, op.group_id, op.keys, why)
        faults.slot(op.dst_tier, op.dst_slot, op.group_id, op.keys, why)
    else:
        faults.slot(op.tier, op.slot, op.group_id, op.keys, why)
        faults.blocks.append(op.block_id)
