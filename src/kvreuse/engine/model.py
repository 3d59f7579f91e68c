"""The tiny decoder: full / sliding attention and a gated linear recurrence, plus a draft head.

Weights live in a flat `{name: tensor}` dict with HF-style names, so a checkpoint is just that
dict in safetensors. The model never touches a cache itself: every layer hands its q/k/v to a
`Context`, which is either `DenseContext` (one cache-free pass over a whole sequence, the
reference) or the paged context of `runner.py` (block tables, DCP ranks, recurrent slots).

    x ─ embed ─► [ x += mixer(norm(x)) ; x += mlp(norm(x)) ] × layers ─► norm ─► h ─► h·Eᵀ
                   mixer: attention (full | sliding) or recurrence

The EAGLE-style draft head predicts the target's next hidden state from (h_t, token t+1) with one
attention layer of its own (its KV lives in the geometry's `draft` group).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from kvreuse.engine.config import ModelConfig
from kvreuse.engine.kernels import attention_partial, gated_scan, rms_norm, rope


class Context(Protocol):
    def attend(self, layer: str, q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
        """Write k/v of this step's positions and attend q over every visible key."""
        ...

    def recur(self, layer: str, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor) -> Tensor:
        """Run the recurrence over this step's positions from the layer's initial state."""
        ...

    def scan(self, layer: str, run: Scan) -> Tensor:
        """Run a recurrent mixer over this step's positions: `run(initial, counts)` gets the
        layer's flat initial state (None at a sequence's start) and the token counts whose
        states the step needs, and returns its outputs and those states."""
        ...


# A recurrent mixer's step: (flat initial state or None, counts) -> (outputs, {count: state})
Scan = Callable[[Tensor | None, set[int]], tuple[Tensor, dict[int, Tensor]]]


class Model(Protocol):
    """What the runner and `LLM` use of a model: kvreuse's tiny one or a Hugging Face family."""

    config: Any

    def forward(self, ids: Tensor, positions: Tensor, ctx: Context) -> Tensor: ...

    def logits(self, hidden: Tensor) -> Tensor: ...

    def dense_logits(self, token_ids: list[int]) -> Tensor: ...

    def draft_forward(
        self, hidden: Tensor, next_ids: Tensor, positions: Tensor, ctx: Context
    ) -> Tensor: ...


class DenseContext:
    """Cache-free reference: attention over the positions themselves, recurrence from zero."""

    def __init__(self, positions: Tensor) -> None:
        self.positions = positions

    def attend(self, layer: str, q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
        return attention_partial(q, self.positions, k, v, self.positions, window)[0]

    def recur(self, layer: str, q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor) -> Tensor:
        state = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
        return gated_scan(q, k, v, log_decay, state, set())[0]

    def scan(self, layer: str, run: Scan) -> Tensor:
        return run(None, set())[0]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the config implies, with its shape (the checkpoint must match exactly)."""
    d = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (cfg.vocab_size, d),
        "norm.weight": (d,),
    }
    for i, kind in enumerate(cfg.layer_types):
        p = f"layers.{i}"
        if kind == "recurrent":
            h, dk, dv = cfg.recurrent_heads, cfg.recurrent_key_dim, cfg.recurrent_value_dim
            shapes[f"{p}.recurrent.in_proj.weight"] = (2 * h * dk + 2 * h * dv, d)
            shapes[f"{p}.recurrent.a_proj.weight"] = (h, d)
            shapes[f"{p}.recurrent.a_bias"] = (h,)
            shapes[f"{p}.recurrent.out_proj.weight"] = (d, h * dv)
        else:
            shapes.update(_attn_shapes(cfg, p))
        shapes.update(_block_shapes(cfg, p))
    if cfg.draft_head:
        shapes["draft.fc.weight"] = (d, 2 * d)
        shapes["draft.hidden_norm.weight"] = (d,)
        shapes["draft.embed_norm.weight"] = (d,)
        shapes["draft.norm.weight"] = (d,)
        shapes.update(_attn_shapes(cfg, "draft"))
        shapes.update(_block_shapes(cfg, "draft"))
    return shapes


def _attn_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    d, hd = cfg.hidden_size, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    return {
        f"{p}.self_attn.q_proj.weight": (nh * hd, d),
        f"{p}.self_attn.k_proj.weight": (nkv * hd, d),
        f"{p}.self_attn.v_proj.weight": (nkv * hd, d),
        f"{p}.self_attn.o_proj.weight": (d, nh * hd),
    }


def _block_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    d, m = cfg.hidden_size, cfg.intermediate_size
    return {
        f"{p}.input_layernorm.weight": (d,),
        f"{p}.post_attention_layernorm.weight": (d,),
        f"{p}.mlp.gate_proj.weight": (m, d),
        f"{p}.mlp.up_proj.weight": (m, d),
        f"{p}.mlp.down_proj.weight": (d, m),
    }


OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, Tensor]:
    """Seeded init: norms 1, embeddings N(0, 1), projections N(0, 1/fan_in) (output projections
    3×), decays ~0.92–0.99. Random but not degenerate: greedy decoding does not just echo."""
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, Tensor] = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            w = torch.ones(shape)
        elif name.endswith("a_bias"):
            w = torch.rand(shape, generator=gen) * 2.0 - 4.5  # softplus ≈ 0.01–0.08
        elif name == "embed_tokens.weight":
            w = torch.randn(shape, generator=gen)
        else:
            scale = 0.1 if name.endswith("a_proj.weight") else 1.0
            if name.endswith(OUTPUT_PROJECTIONS):
                scale = 3.0  # mixers must outweigh the tied embedding, or the model echoes input
            w = torch.randn(shape, generator=gen) * scale / math.sqrt(shape[-1])
        weights[name] = w.to(torch.float32)
    return weights


class TinyModel:
    def __init__(self, config: ModelConfig, weights: dict[str, Tensor]) -> None:
        self.config = config
        self.w = weights

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0) -> TinyModel:
        return cls(config, random_weights(config, seed))

    # ------------------------------------------------------------------ target
    @torch.no_grad()
    def forward(self, ids: Tensor, positions: Tensor, ctx: Context) -> Tensor:
        """Final hidden states (after the last norm) of `ids` at `positions`: [L, hidden]."""
        cfg = self.config
        x = self.w["embed_tokens.weight"][ids]
        for i, kind in enumerate(cfg.layer_types):
            x = self._layer(f"layers.{i}", kind, x, positions, ctx)
        return rms_norm(x, self.w["norm.weight"], cfg.rms_norm_eps)

    def logits(self, hidden: Tensor) -> Tensor:
        return hidden @ self.w["embed_tokens.weight"].T

    @torch.no_grad()
    def dense_logits(self, token_ids: list[int]) -> Tensor:
        """The reference: one cache-free forward over the whole sequence, logits [L, vocab]."""
        ids = torch.tensor(token_ids, dtype=torch.long)
        pos = torch.arange(len(token_ids))
        return self.logits(self.forward(ids, pos, DenseContext(pos)))

    def _layer(self, p: str, kind: str, x: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        eps = self.config.rms_norm_eps
        xn = rms_norm(x, self.w[f"{p}.input_layernorm.weight"], eps)
        if kind == "recurrent":
            x = x + self._recurrent(p, xn, ctx)
        else:
            window = self.config.sliding_window if kind == "sliding" else None
            x = x + self._attention(p, xn, pos, ctx, window)
        xn = rms_norm(x, self.w[f"{p}.post_attention_layernorm.weight"], eps)
        gate = F.silu(xn @ self.w[f"{p}.mlp.gate_proj.weight"].T)
        up = xn @ self.w[f"{p}.mlp.up_proj.weight"].T
        return x + (gate * up) @ self.w[f"{p}.mlp.down_proj.weight"].T

    def _attention(
        self, p: str, xn: Tensor, pos: Tensor, ctx: Context, window: int | None
    ) -> Tensor:
        cfg, n = self.config, xn.shape[0]
        q = (xn @ self.w[f"{p}.self_attn.q_proj.weight"].T).view(n, -1, cfg.head_dim)
        k = (xn @ self.w[f"{p}.self_attn.k_proj.weight"].T).view(n, -1, cfg.head_dim)
        v = (xn @ self.w[f"{p}.self_attn.v_proj.weight"].T).view(n, -1, cfg.head_dim)
        q, k = rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
        o = ctx.attend(p, q, k, v, window)
        return o.reshape(n, -1) @ self.w[f"{p}.self_attn.o_proj.weight"].T

    def _recurrent(self, p: str, xn: Tensor, ctx: Context) -> Tensor:
        cfg, n = self.config, xn.shape[0]
        h, dk, dv = cfg.recurrent_heads, cfg.recurrent_key_dim, cfg.recurrent_value_dim
        proj = xn @ self.w[f"{p}.recurrent.in_proj.weight"].T
        q, k, v, g = proj.split([h * dk, h * dk, h * dv, h * dv], dim=-1)
        q = q.reshape(n, h, dk) / math.sqrt(dk)
        k = F.normalize(k.reshape(n, h, dk), dim=-1)  # bounded updates: |k^T v| <= |v|
        a = xn @ self.w[f"{p}.recurrent.a_proj.weight"].T + self.w[f"{p}.recurrent.a_bias"]
        o = ctx.recur(p, q, k, v.reshape(n, h, dv), -F.softplus(a))
        return (o.reshape(n, -1) * F.silu(g)) @ self.w[f"{p}.recurrent.out_proj.weight"].T

    # ------------------------------------------------------------------ draft head
    @torch.no_grad()
    def draft_forward(
        self, hidden: Tensor, next_ids: Tensor, positions: Tensor, ctx: Context
    ) -> Tensor:
        """EAGLE-style: from the target's hidden at t and the token at t+1, predict the hidden
        at t+1 (its logits propose token t+2). The head's KV at t is built from both inputs."""
        if not self.config.draft_head:
            raise ValueError("this model has no draft head (config draft_head = false)")
        eps = self.config.rms_norm_eps
        hn = rms_norm(hidden, self.w["draft.hidden_norm.weight"], eps)
        en = rms_norm(
            self.w["embed_tokens.weight"][next_ids], self.w["draft.embed_norm.weight"], eps
        )
        x = torch.cat((hn, en), dim=-1) @ self.w["draft.fc.weight"].T
        x = self._layer("draft", "full", x, positions, ctx)
        return rms_norm(x, self.w["draft.norm.weight"], eps)
