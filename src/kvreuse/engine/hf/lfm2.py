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

from collections.abc import Iterator

from torch import Tensor

from kvreuse.engine.hf.base import Family, Want, aliased, attention_shapes, rotary_dim
from kvreuse.engine.hf.ops import (
    RopeDefaults,
    apply_rope,
    attend,
    causal_conv,
    join_state,
    read_rope,
    rms_norm,
    rope_tables,
    silu_mlp,
    split_state,
)
from kvreuse.engine.model import Context
from kvreuse.hfconfig import MAX_SIZE, Fields

# Fields of Lfm2Config and what becomes of each (besides those of Family and ModelSpec, which
# reads conv_L_cache, and full_attn_idxs where layer_types is absent):
#   read: norm_eps, intermediate_size (or its older name block_ff_dim),
#     block_auto_adjust_ff_dim, block_ffn_dim_multiplier, block_multiple_of, conv_bias, the RoPE
#     (rope_parameters, or rope_theta / rope_scaling; base 10⁶ by default), tie_word_embeddings
#     (or its older name tie_embedding; default true)
#   LFM2's attention has no biases and its MLP is SiLU whatever the config says, as in
#   transformers: attention_bias and hidden_act, when present, are ignored.


class Lfm2(Family):
    TIED_DEFAULT = True
    STRUCTURE = "num_hidden_layers, layer_types, conv_bias, tie_word_embeddings"

    def read(self, f: Fields) -> None:
        self.tie = f.flag(aliased(f, "tie_word_embeddings", "tie_embedding"), True)
        self.eps = f.number("norm_eps", 1e-5, above=0)
        self.ff = self._ff_dim(f)
        self.conv_bias = f.flag("conv_bias", False)
        self.rope = read_rope(f, RopeDefaults({"": (1e6, "rope_theta")}))[""]
        rotary_dim(f, self.spec.head_dim, 1.0)

    @staticmethod
    def _ff_dim(f: Fields) -> int:
        """The MLP width: intermediate_size, cut to 2/3, scaled by block_ffn_dim_multiplier
        (null: not) and rounded up to block_multiple_of, as LFM2 sizes it."""
        key = aliased(f, "intermediate_size", "block_ff_dim")
        size = f.integer(key)
        if f.flag("block_auto_adjust_ff_dim", True):
            size = int(2 * size / 3)
            mult = "block_ffn_dim_multiplier"
            if mult not in f.d or f.d[mult] is not None:
                scaled = f.number(mult, 1.0, above=0) * size
                if not scaled < MAX_SIZE:
                    f.fail(mult, f"makes an MLP of width {scaled:.3g}")
                size = int(scaled)
                step = f.integer("block_multiple_of", 256)
                size = step * ((size + step - 1) // step)
        if size < 1:
            f.fail(key, f"gives an MLP of width {size}")
        return size

    def shapes(self) -> Iterator[Want]:
        s = self.spec
        d, hd, m = s.hidden_size, s.head_dim, self.ff
        yield from self.head_shapes()
        yield "model.embedding_norm.weight", (d,), "hidden_size"
        mlp = "hidden_size, intermediate_size, block_ffn_dim_multiplier, block_multiple_of"
        for i, mixer in enumerate(s.mixers):
            p = f"model.layers.{i}"
            yield f"{p}.operator_norm.weight", (d,), "hidden_size"
            yield f"{p}.ffn_norm.weight", (d,), "hidden_size"
            yield f"{p}.feed_forward.w1.weight", (m, d), mlp
            yield f"{p}.feed_forward.w3.weight", (m, d), mlp
            yield f"{p}.feed_forward.w2.weight", (d, m), mlp
            if mixer == "short_conv":
                k = s.states[i][0][1][0] + 1
                yield f"{p}.conv.conv.weight", (d, 1, k), "hidden_size, conv_L_cache"
                yield f"{p}.conv.in_proj.weight", (3 * d, d), "hidden_size"
                yield f"{p}.conv.out_proj.weight", (d, d), "hidden_size"
                if self.conv_bias:
                    yield f"{p}.conv.conv.bias", (d,), "conv_bias, hidden_size"
                    yield f"{p}.conv.in_proj.bias", (3 * d,), "conv_bias, hidden_size"
                    yield f"{p}.conv.out_proj.bias", (d,), "conv_bias, hidden_size"
            else:
                heads = (s.num_attention_heads, s.num_key_value_heads, hd)
                a = f"{p}.self_attn"
                yield from attention_shapes(a, d, heads, out="out_proj", norm="layernorm")

    def _norm(self, name: str, x: Tensor) -> Tensor:
        return rms_norm(x, self.w[name], self.eps)

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
        angles = rope_tables(pos, hd, self.rope.theta, self.rope.factor)
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
