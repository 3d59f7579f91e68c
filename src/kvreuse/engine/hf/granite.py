"""Granite-4.0-H (`granitemoehybrid`): Mamba-2 layers and attention layers, each followed by a
shared SwiGLU MLP plus (when the config has experts) a top-k mixture of experts.

    x = embed · embedding_multiplier
    per layer: x += mixer(norm(x)) · residual_multiplier ; x += ffn(norm(x)) · residual_multiplier
    logits = norm(x) · lm_headᵀ / logits_scaling

Mamba-2 (one layer, L tokens, state = conv window + SSM):

    gate, xBC, dt = in_proj(x)
    xBC = silu(conv1d(window ++ xBC))                     depthwise, kernel k: the window is the
    x, B, C = xBC                                         last k−1 inputs before this step
    dt = clamp(softplus(dt + dt_bias)), A = −exp(A_log)
    S_t = exp(dt_t·A) S_{t−1} + B_tᵀ (dt_t x_t)           S: heads × d_state × d_head
    y_t = C_t S_t + D x_t
    out = out_proj(RMSNorm(y · silu(gate)))

The scan is the engine's chunked gated-linear kernel (`kernels.gated_scan`) with q = C, k = B,
v = dt·x and log-decay dt·A. Attention has no positional encoding unless
`position_embedding_type` is "rope" (Granite-4.0-H has none), and scores scale by
`attention_multiplier`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from kvreuse.engine.hf.base import Family, Want, choice, rotary_dim, silu_only
from kvreuse.engine.hf.ops import (
    Rope,
    RopeDefaults,
    apply_rope,
    attend,
    causal_conv,
    gated_rms_norm,
    join_state,
    read_rope,
    rms_norm,
    rope_tables,
    routed_experts,
    split_state,
)
from kvreuse.engine.kernels import gated_scan
from kvreuse.engine.model import Context
from kvreuse.hfconfig import Fields, show

# Fields of GraniteMoeHybridConfig and what becomes of each (besides those of Family and
# ModelSpec, which reads the mamba_* sizes):
#   read: rms_norm_eps, attention_bias, embedding_multiplier, logits_scaling,
#     residual_multiplier, attention_multiplier, num_local_experts, num_experts_per_tok,
#     intermediate_size (the experts'), shared_intermediate_size, mamba_conv_bias,
#     mamba_proj_bias, time_step_limit, position_embedding_type (null or "nope": no positions;
#     "rope": RoPE from rope_parameters, or rope_theta / rope_scaling), tie_word_embeddings
#   refused unless the default: hidden_act (silu)
#   ignored: mamba_chunk_size (how the scan is chunked, not what it computes);
#     output_router_logits and router_aux_loss_coef (the training loss)


class Granite(Family):
    STRUCTURE = (
        "num_hidden_layers, layer_types, num_local_experts, attention_bias, mamba_conv_bias, "
        "mamba_proj_bias, tie_word_embeddings"
    )

    def read(self, f: Fields) -> None:
        silu_only(f)
        self.eps = f.number("rms_norm_eps", 1e-6, above=0)
        self.bias = f.flag("attention_bias", False)
        self.embedding_multiplier = f.number("embedding_multiplier", 1.0)
        self.logits_scaling = f.number("logits_scaling", 1.0)
        if self.logits_scaling == 0:
            f.fail("logits_scaling", "is 0; the logits are divided by it")
        self.residual_multiplier = f.number("residual_multiplier", 1.0)
        self.attention_multiplier = f.number("attention_multiplier", 1.0)
        self.experts = f.integer("num_local_experts", lo=0)
        if self.experts:
            self.top_k = f.integer("num_experts_per_tok", 2, hi=self.experts)
            self.expert_ff = f.integer("intermediate_size")
        self.shared_ff = f.integer("shared_intermediate_size")
        self.rope: Rope | None = None
        if choice(f, "position_embedding_type", None, (None, "nope", "rope")) == "rope":
            self.rope = read_rope(f, RopeDefaults({"": (1e4, "rope_theta")}))[""]
            rotary_dim(f, self.spec.head_dim, 1.0)
        if "mamba2" in self.spec.mixers:
            self._read_mamba(f)

    def _read_mamba(self, f: Fields) -> None:
        # the sizes ModelSpec has checked (mamba_n_heads divides the inner size, and so on)
        inner = f.integer("mamba_expand") * self.spec.hidden_size
        heads, groups = f.integer("mamba_n_heads"), f.integer("mamba_n_groups")
        n, k = f.integer("mamba_d_state"), f.integer("mamba_d_conv")
        self.dims = inner, heads, groups, n, inner // heads, k
        self.conv_bias = f.flag("mamba_conv_bias", True)
        self.proj_bias = f.flag("mamba_proj_bias", False)
        self.dt_limits = _limits(f)

    def shapes(self) -> Iterator[Want]:
        s = self.spec
        d, hd = s.hidden_size, s.head_dim
        yield from self.head_shapes()
        yield "model.norm.weight", (d,), "hidden_size"
        for i, mixer in enumerate(s.mixers):
            p = f"model.layers.{i}"
            yield f"{p}.input_layernorm.weight", (d,), "hidden_size"
            yield f"{p}.post_attention_layernorm.weight", (d,), "hidden_size"
            m, why = self.shared_ff, "hidden_size, shared_intermediate_size"
            yield f"{p}.shared_mlp.input_linear.weight", (2 * m, d), why
            yield f"{p}.shared_mlp.output_linear.weight", (d, m), why
            if self.experts:
                e, ie = self.experts, self.expert_ff
                why = "num_local_experts, hidden_size, intermediate_size"
                yield f"{p}.block_sparse_moe.router.layer.weight", (e, d), why
                yield f"{p}.block_sparse_moe.input_linear.weight", (e, 2 * ie, d), why
                yield f"{p}.block_sparse_moe.output_linear.weight", (e, d, ie), why
            if mixer == "mamba2":
                yield from self._mamba_shapes(f"{p}.mamba")
            else:
                yield from self._attention_shapes(f"{p}.self_attn", d, hd)

    def _mamba_shapes(self, q: str) -> Iterator[Want]:
        d = self.spec.hidden_size
        inner, heads, groups, n, _, k = self.dims
        conv_dim = inner + 2 * groups * n
        why = "hidden_size, mamba_expand, mamba_n_heads, mamba_n_groups, mamba_d_state"
        yield f"{q}.in_proj.weight", (inner + conv_dim + heads, d), why
        yield f"{q}.conv1d.weight", (conv_dim, 1, k), f"{why}, mamba_d_conv"
        for name in ("dt_bias", "A_log", "D"):
            yield f"{q}.{name}", (heads,), "mamba_n_heads"
        yield f"{q}.norm.weight", (inner,), "hidden_size, mamba_expand"
        yield f"{q}.out_proj.weight", (d, inner), "hidden_size, mamba_expand"
        if self.conv_bias:
            yield f"{q}.conv1d.bias", (conv_dim,), f"mamba_conv_bias, {why}"
        if self.proj_bias:
            yield f"{q}.in_proj.bias", (inner + conv_dim + heads,), f"mamba_proj_bias, {why}"
            yield f"{q}.out_proj.bias", (d,), "mamba_proj_bias, hidden_size"

    def _attention_shapes(self, q: str, d: int, hd: int) -> Iterator[Want]:
        nh, nkv = self.spec.num_attention_heads, self.spec.num_key_value_heads
        why = "hidden_size, num_attention_heads, num_key_value_heads, head_dim"
        for name, size in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
            yield f"{q}.{name}_proj.weight", (size, d), why
        yield f"{q}.o_proj.weight", (d, nh * hd), why
        if self.bias:
            for name, size in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd), ("o", d)):
                yield f"{q}.{name}_proj.bias", (size,), f"attention_bias, {why}"

    def embed(self, ids: Tensor) -> Tensor:
        return super().embed(ids) * self.embedding_multiplier

    def layer(self, i: int, x: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        p, res = f"model.layers.{i}", self.residual_multiplier
        h = rms_norm(x, self.w[f"{p}.input_layernorm.weight"], self.eps)
        if self.spec.mixers[i] == "mamba2":
            h = ctx.scan(f"layers.{i}", lambda s0, want: self._mamba(i, h, s0, want))
        else:
            h = self._attention(i, h, pos, ctx)
        x = x + h * res
        h = rms_norm(x, self.w[f"{p}.post_attention_layernorm.weight"], self.eps)
        return x + self._ffn(p, h) * res

    def final(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.w["model.norm.weight"], self.eps)

    def logits(self, h: Tensor) -> Tensor:
        return super().logits(h) / self.logits_scaling

    def _attention(self, i: int, h: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        p, n, hd = f"model.layers.{i}.self_attn", h.shape[0], self.spec.head_dim
        q = self._linear(f"{p}.q_proj", h).view(n, -1, hd)
        k = self._linear(f"{p}.k_proj", h).view(n, -1, hd)
        v = self._linear(f"{p}.v_proj", h).view(n, -1, hd)
        if self.rope is not None:
            angles = rope_tables(pos, hd, self.rope.theta, self.rope.factor)
            q, k = apply_rope(q, angles), apply_rope(k, angles)
        o = attend(ctx, f"layers.{i}", q, k, v, None, self.attention_multiplier)
        return self._linear(f"{p}.o_proj", o.reshape(n, -1))

    def _ffn(self, p: str, h: Tensor) -> Tensor:
        gate, up = (h @ self.w[f"{p}.shared_mlp.input_linear.weight"].T).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ self.w[f"{p}.shared_mlp.output_linear.weight"].T
        if not self.experts:
            return out
        m = f"{p}.block_sparse_moe"
        logits = h @ self.w[f"{m}.router.layer.weight"].T
        top, index = logits.topk(self.top_k, dim=-1)
        inp, outp = self.w[f"{m}.input_linear.weight"], self.w[f"{m}.output_linear.weight"]
        half = inp.shape[1] // 2
        experts = [(inp[e, :half], inp[e, half:], outp[e]) for e in range(inp.shape[0])]
        return out + routed_experts(h, index, torch.softmax(top, dim=-1), experts)

    def _mamba(
        self, i: int, h: Tensor, s0: Tensor | None, want: set[int]
    ) -> tuple[Tensor, dict[int, Tensor]]:
        p = f"model.layers.{i}.mamba"
        inner, heads, groups, n, d_head, _ = self.dims
        L = h.shape[0]
        window, ssm = split_state(s0, self.spec.states[i])
        gate, xbc, dt = self._linear(f"{p}.in_proj", h).split(
            [inner, inner + 2 * groups * n, heads], dim=-1
        )
        conv, windows = causal_conv(
            xbc, window, self.w[f"{p}.conv1d.weight"], self.w.get(f"{p}.conv1d.bias"), want
        )
        xs, B, C = F.silu(conv).split([inner, groups * n, groups * n], dim=-1)
        lo, hi = self.dt_limits
        dt = torch.clamp(F.softplus(dt + self.w[f"{p}.dt_bias"]), min=lo, max=hi)
        A = -torch.exp(self.w[f"{p}.A_log"])
        xs = xs.view(L, heads, d_head)
        rep = heads // groups
        B = B.view(L, groups, n).repeat_interleave(rep, dim=1)
        C = C.view(L, groups, n).repeat_interleave(rep, dim=1)
        y, _, states = gated_scan(C, B, xs * dt[..., None], dt * A, ssm.clone(), want)
        y = (y + self.w[f"{p}.D"][:, None] * xs).reshape(L, inner)
        y = gated_rms_norm(y, gate, self.w[f"{p}.norm.weight"], self.eps, True)
        out = self._linear(f"{p}.out_proj", y)
        return out, {t: join_state(windows[t], states[t]) for t in want}


def _limits(f: Fields) -> tuple[float, float]:
    """time_step_limit: the [min, max] dt is clamped to (null: no limit). transformers writes
    infinity as {"__float__": "Infinity"}, JSON readers as the bare Infinity."""
    value = f.d.get("time_step_limit")
    if value is None:
        return 0.0, math.inf
    pair = value if isinstance(value, list) and len(value) == 2 else []
    bounds = [b for b in map(_bound, pair) if b is not None]
    if len(bounds) != 2 or bounds[0] > bounds[1]:
        f.fail("time_step_limit", f"must be [min, max] with min ≤ max, got {show(value)}")
    return bounds[0], bounds[1]


def _bound(v: object) -> float | None:
    if (
        isinstance(v, dict)
        and v.keys() == {"__float__"}
        and v["__float__"] in ("Infinity", "-Infinity")
    ):
        return float(v["__float__"])
    if isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v):
        return float(v)
    return None
