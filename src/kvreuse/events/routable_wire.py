"""The routable mode's wire events: one batch's net change of what is published.

The filter (`kvreuse.events.routable`) decides which attention units are published; this turns
the units retracted and published during a batch into `BlockRemoved` and `BlockStored` events.
A stretch of units that one core run carries goes out as one slice of that run's chain and
tokens, so a new run costs a few C-level steps rather than a Python step per unit. Each
event carries vLLM's per-block `extra_keys`, as the groups mode does (`convert.block_extra_keys`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvreuse.events.convert import block_extra_keys
from kvreuse.events.wire import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    WireEvent,
    hash64,
    low64,
    stored_run,
)

if TYPE_CHECKING:
    from kvreuse.events.routable_tree import Run, UnitTree


def emit_removed(out: list[WireEvent], gid: int, gone: Mapping[bytes, int]) -> None:
    """One `BlockRemoved` for every retracted unit (`gone`: hash -> boundary), deepest first:
    a consumer that drops a block's descendants with it (Dynamo) then never meets a removal
    of a block it already dropped."""
    order = sorted(gone, key=gone.__getitem__, reverse=True)  # stable: ties keep their order
    out.append(BlockRemoved(low64(order), MEDIUM_GPU, group_idx=gid))


def emit_stored(
    out: list[WireEvent], tree: UnitTree, stretches: list[tuple[int, bytes, Run, int, int]]
) -> None:
    """`BlockStored` events for the stretches published during a batch (`UnitTree.came`:
    entries [a, b) of a run, in order of their first boundary, so every parent goes before
    its child). A stretch is a slice of its run's chain and tokens; one that continues the
    previous event's chain extends that event."""
    u = tree.hash_unit
    for _, _, r, a, b in stretches:
        ev, start = r.ev, r.ev.token_start
        first, last = r.first + a * u, r.first + (b - 1) * u
        tokens = ev.token_ids[first - u - start : last - start]
        lookahead = [list(t) for t in ev.successor_token_ids[a:b]] if tree.geo.lookahead else None
        lora = ev.lora[0] if ev.lora else None
        parent = None if first == u else r.chain[r.i0 + a - 1]
        extra = block_extra_keys(ev, range(first, last + 1, u), tree.geo.vllm_hashes)
        stretch = r.chain[r.i0 + a : r.i0 + b]
        _append(out, tree, stretch, parent, tokens, lookahead, lora, extra)


def _append(
    out: list[WireEvent],
    tree: UnitTree,
    stretch: Sequence[bytes],
    parent: bytes | None,
    tokens: Sequence[int],
    lookahead: list[list[int]] | None,
    lora: str | None,
    extra: list[tuple[Any, ...] | None] | None,
) -> None:
    up = hash64(parent) if parent is not None else None
    last = out[-1] if out else None
    if (
        isinstance(last, BlockStored)
        and up is not None
        and last.block_hashes[-1] == up
        and last.lora_name == lora
    ):
        last.block_hashes.extend(low64(stretch))
        last.token_ids.extend(tokens)
        if last.extra_keys is not None or extra is not None:  # one entry per block, or None
            had = last.extra_keys or [None] * (len(last.block_hashes) - len(stretch))
            last.extra_keys = had + (extra or [None] * len(stretch))
        if last.lookahead_token_ids is not None and lookahead is not None:
            last.lookahead_token_ids.extend(lookahead)
        return
    spec = (tree.geo.groups[tree.gid].wire_kind, None)
    out.append(
        stored_run(
            low64(stretch), up, list(tokens), tree.hash_unit, tree.gid, spec, lora, extra, lookahead
        )
    )
