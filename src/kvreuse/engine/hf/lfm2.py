"""LFM2 (`lfm2`): short-convolution layers and attention layers, each followed by SwiGLU.

    per layer: x += mixer(norm(x)) ; x += SwiGLU(norm(x))
    logits = norm(x) · Eᵀ                           (the final norm is `embedding_norm`)

The short convolution (state = conv window of the last L−1 values of B·x, L = conv_L_cache):

    B, C, x = in_proj(x)
    y = C · conv1d(window ++ B·x)                   depthwise, kernel L, no activation
    out = out_proj(y)

Attention RMS-normalises q and k per head (`q_layernorm`, `k_layernorm`) before RoPE.
"""

from __future__ import annotations

from torch import Tensor

from kvreuse.engine.hf.base import Family, attention_shapes
from kvreuse.engine.hf.ops import (
    apply_rope,
    attend,
    causal_conv,
    join_state,
    rms_norm,
    rope_tables,
    silu_mlp,
    split_state,
)
from kvreuse.engine.model import Context


class Lfm2(Family):
    def _ff_dim(self) -> int:
        c = self.c
        size = c["intermediate_size"]
        if c.get("block_auto_adjust_ff_dim", True):
            size = int(2 * size / 3)
            mult = c.get("block_ffn_dim_multiplier")
            if mult is not None:
                size = int(mult * size)
                step = c["block_multiple_of"]
                size = step * ((size + step - 1) // step)
        return int(size)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        c, s = self.c, self.spec
        d, hd, m = s.hidden_size, s.head_dim, self._ff_dim()
        nh, nkv = c["num_attention_heads"], s.num_key_value_heads
        out = {**self.head_shapes(), "model.embedding_norm.weight": (d,)}
        for i, mixer in enumerate(s.mixers):
            p = f"model.layers.{i}"
            out[f"{p}.operator_norm.weight"] = (d,)
            out[f"{p}.ffn_norm.weight"] = (d,)
            out[f"{p}.feed_forward.w1.weight"] = (m, d)
            out[f"{p}.feed_forward.w3.weight"] = (m, d)
            out[f"{p}.feed_forward.w2.weight"] = (d, m)
            if mixer == "short_conv":
                out[f"{p}.conv.conv.weight"] = (d, 1, c["conv_L_cache"])
                out[f"{p}.conv.in_proj.weight"] = (3 * d, d)
                out[f"{p}.conv.out_proj.weight"] = (d, d)
                if c.get("conv_bias"):
                    out[f"{p}.conv.conv.bias"] = (d,)
                    out[f"{p}.conv.in_proj.bias"] = (3 * d,)
                    out[f"{p}.conv.out_proj.bias"] = (d,)
            else:
                heads = (nh, nkv, hd)
                a = f"{p}.self_attn"
                out.update(attention_shapes(a, d, heads, out="out_proj", norm="layernorm"))
        return out

    def _norm(self, name: str, x: Tensor) -> Tensor:
        return rms_norm(x, self.w[name], self.c["norm_eps"])

    def layer(self, i: int, x: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        p = f"model.layers.{i}"
        h = self._norm(f"{p}.operator_norm.weight", x)
        if self.spec.mixers[i] == "short_conv":
            h = ctx.scan(f"layers.{i}", lambda s0, want: self._conv(i, h, s0, want))
        else:
            h = self._attention(i, h, pos, ctx)
        x = x + h
        h = self._norm(f"{p}.ffn_norm.weight", x)
        f = f"{p}.feed_forward"
        return x + silu_mlp(
            h, self.w[f"{f}.w1.weight"], self.w[f"{f}.w3.weight"], self.w[f"{f}.w2.weight"]
        )

    def final(self, x: Tensor) -> Tensor:
        return self._norm("model.embedding_norm.weight", x)

    def _attention(self, i: int, h: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        p, n, hd = f"model.layers.{i}.self_attn", h.shape[0], self.spec.head_dim
        q = self._norm(
            f"{p}.q_layernorm.weight", (h @ self.w[f"{p}.q_proj.weight"].T).view(n, -1, hd)
        )
        k = self._norm(
            f"{p}.k_layernorm.weight", (h @ self.w[f"{p}.k_proj.weight"].T).view(n, -1, hd)
        )
        v = (h @ self.w[f"{p}.v_proj.weight"].T).view(n, -1, hd)
        rope = self.c.get("rope_parameters") or {}
        angles = rope_tables(pos, hd, float(rope.get("rope_theta", 1e6)))
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        o = attend(ctx, f"layers.{i}", q, k, v, None, hd**-0.5)
        return o.reshape(n, -1) @ self.w[f"{p}.out_proj.weight"].T

    def _conv(
        self, i: int, h: Tensor, s0: Tensor | None, want: set[int]
    ) -> tuple[Tensor, dict[int, Tensor]]:
        p = f"model.layers.{i}.conv"
        (window,) = split_state(s0, self.spec.states[i])
        B, C, x = self._linear(f"{p}.in_proj", h).chunk(3, dim=-1)
        conv, windows = causal_conv(
            B * x, window, self.w[f"{p}.conv.weight"], self.w.get(f"{p}.conv.bias"), want
        )
        out = self._linear(f"{p}.out_proj", C * conv)
        return out, {t: join_state(windows[t]) for t in want}
