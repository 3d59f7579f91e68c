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
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from kvreuse.engine.hf.base import Family, Want, attention_shapes, choice, rotary_dim
from kvreuse.engine.hf.ops import RopeDefaults, apply_rope, attend, read_rope, rms_norm, rope_tables
from kvreuse.engine.model import Context
from kvreuse.hfconfig import Fields

# Gemma 3's RoPE: full attention 10⁶ (transformers 4: `rope_theta`, scaled by `rope_scaling`),
# sliding attention 10⁴ (transformers 4: `rope_local_base_freq`, never scaled)
ROPE = RopeDefaults(
    {"full_attention": (1e6, "rope_theta"), "sliding_attention": (1e4, "rope_local_base_freq")}
)

# Fields of Gemma3TextConfig and what becomes of each (besides those of Family and ModelSpec):
#   read: rms_norm_eps, intermediate_size, attention_bias, query_pre_attn_scalar,
#     final_logit_softcapping, the RoPE (see ROPE), tie_word_embeddings (default true)
#   refused unless the default: hidden_activation (gelu_pytorch_tanh), attn_logit_softcapping
#     (null: the paged attention has no score capping), use_bidirectional_attention (false)


class Gemma3(Family):
    TIED_DEFAULT = True
    STRUCTURE = "num_hidden_layers, attention_bias, tie_word_embeddings"

    def read(self, f: Fields) -> None:
        choice(f, "hidden_activation", "gelu_pytorch_tanh", ("gelu_pytorch_tanh",), " (GeGLU)")
        if f.has("attn_logit_softcapping"):
            f.fail(
                "attn_logit_softcapping",
                "is set; the engine's attention does not soft-cap scores (null only)",
            )
        choice(f, "use_bidirectional_attention", False, (False,), " (the engine is causal)")
        self.eps = f.number("rms_norm_eps", 1e-6, above=0)
        self.ff = f.integer("intermediate_size")
        self.bias = f.flag("attention_bias", False)
        self.scale = f.number("query_pre_attn_scalar", 256, above=0) ** -0.5
        cap = "final_logit_softcapping"
        self.cap = f.number(cap, above=0) if f.has(cap) else None
        self.rope = read_rope(f, ROPE)
        for rope in self.rope.values():
            rotary_dim(f, self.spec.head_dim, rope.fraction)

    def shapes(self) -> Iterator[Want]:
        s = self.spec
        d, hd, m = s.hidden_size, s.head_dim, self.ff
        yield from self.head_shapes()
        yield "model.norm.weight", (d,), "hidden_size"
        for i in range(len(s.layer_kinds)):
            p = f"model.layers.{i}"
            for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
                yield f"{p}.{norm}_layernorm.weight", (d,), "hidden_size"
            heads = (s.num_attention_heads, s.num_key_value_heads, hd)
            yield from attention_shapes(f"{p}.self_attn", d, heads, bias=self.bias)
            why = "hidden_size, intermediate_size"
            yield f"{p}.mlp.gate_proj.weight", (m, d), why
            yield f"{p}.mlp.up_proj.weight", (m, d), why
            yield f"{p}.mlp.down_proj.weight", (d, m), why

    def _norm(self, name: str, x: Tensor) -> Tensor:
        return rms_norm(x, self.w[name], self.eps, offset=1.0)

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
        return z if self.cap is None else torch.tanh(z / self.cap) * self.cap

    def _attention(self, i: int, h: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        p, n, hd = f"model.layers.{i}.self_attn", h.shape[0], self.spec.head_dim
        sliding = self.spec.layer_kinds[i] == "sliding"
        q = self._norm(f"{p}.q_norm.weight", self._linear(f"{p}.q_proj", h).view(n, -1, hd))
        k = self._norm(f"{p}.k_norm.weight", self._linear(f"{p}.k_proj", h).view(n, -1, hd))
        v = self._linear(f"{p}.v_proj", h).view(n, -1, hd)
        rope = self.rope["sliding_attention" if sliding else "full_attention"]
        angles = rope_tables(pos, hd, rope.theta, rope.factor)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        window = self.spec.sliding_window if sliding else None
        o = attend(ctx, f"layers.{i}", q, k, v, window, self.scale)
        return self._linear(f"{p}.o_proj", o.reshape(n, -1))
