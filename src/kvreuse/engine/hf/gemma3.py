"""Gemma 3 text (`gemma3_text`): sliding-window and full attention layers in the config's
`layer_types` pattern, each with its own RoPE base (`rope_parameters` per layer type).

    x = embed · √hidden
    per layer: x += post_norm(attn(norm(x))) ; x += post_ff_norm(GeGLU(pre_ff_norm(x)))
    logits = softcap(norm(x) · Eᵀ)                    softcap(z) = c · tanh(z / c), when set

Every RMSNorm multiplies by (1 + w); q and k are RMS-normalised per head before RoPE; scores
scale by query_pre_attn_scalar^−½. Sliding layers see keys p − W < k ≤ p (W = sliding_window),
the core's sliding group of window W.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvreuse.engine.hf.base import Family, attention_shapes
from kvreuse.engine.hf.ops import apply_rope, attend, rms_norm, rope_tables
from kvreuse.engine.model import Context
from kvreuse.hfconfig import ModelSpec

ROPE_TYPES = ("default", "linear")


class Gemma3(Family):
    def __init__(self, spec: ModelSpec, w: dict[str, Tensor]) -> None:
        super().__init__(spec, w)
        if self.c.get("attn_logit_softcapping") is not None:
            raise ValueError(
                "config.json: attn_logit_softcapping is set; the engine supports Gemma 3's "
                "attention without score soft-capping (null), as Gemma 3 checkpoints have it"
            )
        if self.c.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention must be false (causal)")
        for kind, rope in self._rope_params().items():
            if rope.get("rope_type", "default") not in ROPE_TYPES:
                raise ValueError(
                    f"config.json: rope_parameters[{kind!r}] has rope_type "
                    f"{rope.get('rope_type')!r}; supported: {list(ROPE_TYPES)}"
                )

    def _rope_params(self) -> dict[str, dict[str, Any]]:
        rope = self.c.get("rope_parameters") or {}
        return {
            "full_attention": dict(rope.get("full_attention") or {"rope_theta": 1e6}),
            "sliding_attention": dict(rope.get("sliding_attention") or {"rope_theta": 1e4}),
        }

    def shapes(self) -> dict[str, tuple[int, ...]]:
        c, s = self.c, self.spec
        d, hd, m = s.hidden_size, s.head_dim, c["intermediate_size"]
        nh, nkv = c["num_attention_heads"], s.num_key_value_heads
        out = {**self.head_shapes(), "model.norm.weight": (d,)}
        for i in range(len(s.layer_kinds)):
            p = f"model.layers.{i}"
            for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
                out[f"{p}.{norm}_layernorm.weight"] = (d,)
            heads = (nh, nkv, hd)
            bias = bool(c.get("attention_bias"))
            out.update(attention_shapes(f"{p}.self_attn", d, heads, bias=bias))
            out[f"{p}.mlp.gate_proj.weight"] = (m, d)
            out[f"{p}.mlp.up_proj.weight"] = (m, d)
            out[f"{p}.mlp.down_proj.weight"] = (d, m)
        return out

    def _norm(self, name: str, x: Tensor) -> Tensor:
        return rms_norm(x, self.w[name], self.c["rms_norm_eps"], offset=1.0)

    def embed(self, ids: Tensor) -> Tensor:
        # the reference stores √hidden as a float32 tensor before multiplying
        return super().embed(ids) * torch.tensor(math.sqrt(self.spec.hidden_size))

    def layer(self, i: int, x: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        p = f"model.layers.{i}"
        h = self._attention(i, self._norm(f"{p}.input_layernorm.weight", x), pos, ctx)
        x = x + self._norm(f"{p}.post_attention_layernorm.weight", h)
        h = self._norm(f"{p}.pre_feedforward_layernorm.weight", x)
        gate = F.gelu(h @ self.w[f"{p}.mlp.gate_proj.weight"].T, approximate="tanh")
        h = (gate * (h @ self.w[f"{p}.mlp.up_proj.weight"].T)) @ self.w[
            f"{p}.mlp.down_proj.weight"
        ].T
        return x + self._norm(f"{p}.post_feedforward_layernorm.weight", h)

    def final(self, x: Tensor) -> Tensor:
        return self._norm("model.norm.weight", x)

    def logits(self, h: Tensor) -> Tensor:
        z = super().logits(h)
        cap = self.c.get("final_logit_softcapping")
        return z if cap is None else torch.tanh(z / cap) * cap

    def _attention(self, i: int, h: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        p, n, hd = f"model.layers.{i}.self_attn", h.shape[0], self.spec.head_dim
        sliding = self.spec.layer_kinds[i] == "sliding"
        q = self._norm(f"{p}.q_norm.weight", self._linear(f"{p}.q_proj", h).view(n, -1, hd))
        k = self._norm(f"{p}.k_norm.weight", self._linear(f"{p}.k_proj", h).view(n, -1, hd))
        v = self._linear(f"{p}.v_proj", h).view(n, -1, hd)
        rope = self._rope_params()["sliding_attention" if sliding else "full_attention"]
        factor = float(rope.get("factor", 1.0)) if rope.get("rope_type") == "linear" else 1.0
        angles = rope_tables(pos, hd, float(rope["rope_theta"]), factor)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        window = self.spec.sliding_window if sliding else None
        scale = float(self.c["query_pre_attn_scalar"]) ** -0.5
        o = attend(ctx, f"layers.{i}", q, k, v, window, scale)
        return self._linear(f"{p}.o_proj", o.reshape(n, -1))
