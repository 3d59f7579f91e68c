"""Paged KV and recurrent-state storage, and the per-step context the model runs in.

Layout (one tensor pair per attention layer, one state tensor per recurrent layer, each with
`num_blocks` slots indexed by the core's block ids; block 0 is the never-read null block):

    K, V   [R, num_blocks, block_size, kv_heads, head_dim]   R = dcp if the group is sharded
    state  [num_blocks, heads, key_dim, value_dim]            replicated (never sharded)

A sharded page of B = block_size × R tokens is interleaved over the R simulated ranks: token p
lives on rank p mod R, in the block `table[p // B]`, at local slot (p mod B) // R.

    page j (B = 8, R = 4, block_size 2):  positions 8j .. 8j+7
      rank 0: 8j+0 8j+4      rank 1: 8j+1 8j+5      rank 2: 8j+2 8j+6      rank 3: 8j+3 8j+7
              slot0 slot1

The same block id names the page on every rank, so a Copy (CoW, E1) copies block src to dst on
every rank and for every layer of the group. Attention is computed per rank over that rank's
keys and merged by log-sum-exp (`kernels.merge_partials`), as a DCP engine does.

Each group gets its own tensors (spec §4 allows it: (number of groups)× the memory of vLLM's
shared-slot layout, which a tiny CPU model can afford).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kvreuse.core import CacheConfig, Copy, Geometry, RequestPlan
from kvreuse.core.spi import Stage
from kvreuse.engine.config import ModelConfig
from kvreuse.engine.kernels import attention_partial, gated_scan, merge_partials
from kvreuse.engine.model import Scan


def map_layers(model: ModelConfig | Any, geo: Geometry) -> dict[str, int]:
    """Layer name -> group id. Raises ValueError when the geometry lacks a group a layer needs."""

    def first(kind: str, role: str = "target") -> int | None:
        return next((g.group_id for g in geo.groups if g.kind == kind and g.role == role), None)

    out: dict[str, int] = {}
    for i, kind in enumerate(model.layer_types):
        gid = first(kind)
        if gid is None:
            raise ValueError(
                f"layer {i} is {kind!r} but the geometry has no {kind!r} group of role target; "
                f"groups: {[g.describe() for g in geo.groups]}"
            )
        g = geo.groups[gid]
        if g.window is not None and g.window != model.sliding_window:
            raise ValueError(
                f"layer {i}: model sliding_window {model.sliding_window} differs from the "
                f"geometry's window {g.window} ({g.describe()})"
            )
        out[f"layers.{i}"] = gid
    draft = next((g.group_id for g in geo.groups if g.is_draft and g.stage is Stage.FULL), None)
    if model.draft_head and draft is not None:
        out["draft"] = draft
    return out


class PagedCache:
    def __init__(self, cache: CacheConfig, model: ModelConfig | Any, dtype: torch.dtype) -> None:
        """`model`: a config with layer_types, sliding_window, draft_head, kv_shape(layer) and
        state_shape(layer) (`ModelConfig`, or a Hugging Face family's)."""
        geo = cache.geometry
        self.geo = geo
        self.dcp = cache.dcp_size
        self.layer_group = map_layers(model, geo)
        self.members: dict[int, list[str]] = {}
        self.kv: dict[str, tuple[Tensor, Tensor]] = {}
        self.state: dict[str, Tensor] = {}
        n = geo.num_blocks
        shape: tuple[int, ...]  # [R, n, block, heads, dim] for attention, [n, *state] else
        for layer, gid in self.layer_group.items():
            g = geo.groups[gid]
            self.members.setdefault(gid, []).append(layer)
            if g.is_attention:
                ranks = self.dcp if g.sharded else 1
                shape = (ranks, n, g.block_size, *model.kv_shape(layer))
                self.kv[layer] = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
            else:
                self.state[layer] = torch.zeros((n, *model.state_shape(layer)), dtype=dtype)

    def copy(self, c: Copy) -> None:
        """E1: duplicate block src into dst for every layer of the group, on every rank."""
        for layer in self.members.get(c.group_id, []):
            if layer in self.kv:
                for t in self.kv[layer]:
                    t[:, c.dst] = t[:, c.src]
            else:
                self.state[layer][c.dst] = self.state[layer][c.src]

    def read_block(self, group_id: int, block_id: int) -> dict[str, Tensor]:
        """A copy of block `block_id` of every layer of the group, on every rank (what a tier
        keeps): per layer, K and V stacked ([2, R, block, heads, dim]) or the state."""
        out = {}
        for layer in self.members.get(group_id, []):
            if layer in self.kv:
                k, v = self.kv[layer]
                out[layer] = torch.stack((k[:, block_id], v[:, block_id]))
            else:
                out[layer] = self.state[layer][block_id].clone()
        return out

    def write_block(self, group_id: int, block_id: int, data: dict[str, Tensor]) -> None:
        """Put what `read_block` gave back into block `block_id` (a load from a tier)."""
        layers = self.members.get(group_id, [])
        if sorted(data) != sorted(layers):
            raise ValueError(f"a tier block of group {group_id} names layers {sorted(data)}")
        for layer in layers:
            if layer in self.kv:
                k, v = self.kv[layer]
                k[:, block_id], v[:, block_id] = data[layer][0], data[layer][1]
            else:
                self.state[layer][block_id] = data[layer]

    def ranks(self, layer: str) -> int:
        return self.kv[layer][0].shape[0]

    def locate(self, layer: str, table: list[int], pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(rank, block, slot) of each absolute position (the diagram above)."""
        ranks = self.ranks(layer)
        page = self.kv[layer][0].shape[2] * ranks
        blocks = torch.tensor(table, dtype=torch.long)[pos // page]
        return pos % ranks, blocks, (pos % page) // ranks


class PagedContext:
    """One request's forward over positions [start, end) against the paged cache.

    Recurrent layers keep the state after every count in `want` in memory; `finish(t_new)`
    then writes `live` and the saves, so states after rejected drafts never reach the cache.
    """

    def __init__(
        self, cache: PagedCache, plan: RequestPlan, positions: Tensor, want: set[int]
    ) -> None:
        self.cache = cache
        self.plan = plan
        self.positions = positions
        self.start = int(positions[0])
        self.want = want
        self.states: dict[str, dict[int, Tensor]] = {}

    def attend(self, layer: str, q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
        cache, pos = self.cache, self.positions
        table = self.plan.tables[cache.layer_group[layer]]
        kc, vc = cache.kv[layer]
        r, b, s = cache.locate(layer, table, pos)
        kc[r, b, s], vc[r, b, s] = k, v  # E2: only this step's positions, own table
        lo = 0 if window is None else max(0, self.start - window + 1)
        keys = torch.arange(lo, int(pos[-1]) + 1)
        parts = []
        for rank in range(cache.ranks(layer)):
            mine = keys[keys % cache.ranks(layer) == rank]
            if mine.numel() == 0:
                continue
            rr, bb, ss = cache.locate(layer, table, mine)
            parts.append(attention_partial(q, pos, kc[rr, bb, ss], vc[rr, bb, ss], mine, window))
        return merge_partials(parts)

    def recur(self, layer: str, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor) -> Tensor:
        def run(s0: Tensor | None, offsets: set[int]) -> tuple[Tensor, dict[int, Tensor]]:
            init = q.new_zeros(self.cache.state[layer].shape[1:]) if s0 is None else s0
            out, _, states = gated_scan(q, k, v, log_decay, init, offsets)
            return out, states

        return self.scan(layer, run)

    def scan(self, layer: str, run: Scan) -> Tensor:
        """Run a recurrent mixer from the layer's initial state (zero, or `live` after the
        step's copies) and keep its state after every needed count for `finish`."""
        slot = self.plan.recurrent[self.cache.layer_group[layer]]
        s0 = None if slot.init == "zero" else self.cache.state[layer][slot.live].clone()
        n = len(self.positions)
        offsets = {c - self.start for c in self.want if self.start < c <= self.start + n}
        out, states = run(s0, offsets)
        self.states[layer] = {self.start + i: st for i, st in states.items()}
        return out

    def finish(self, t_new: int) -> list[int]:
        """E3/E6: leave the state after t_new tokens in `live`, write the saves at positions
        <= t_new, and return the positions written."""
        cache = self.cache
        for layer, states in self.states.items():
            slot = self.plan.recurrent[cache.layer_group[layer]]
            cache.state[layer][slot.live] = states[t_new]
        saved = []
        for save in self.plan.saves:
            layers = cache.members.get(save.group_id, [])
            if save.position > t_new or any(save.position not in self.states[x] for x in layers):
                continue
            for layer in layers:
                cache.state[layer][save.block] = self.states[layer][save.position]
            saved.append(save.position)
        return saved
