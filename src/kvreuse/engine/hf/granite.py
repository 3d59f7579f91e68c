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

import torch
import torch.nn.functional as F
from torch import Tensor

from kvreuse.engine.hf.base import Family
from kvreuse.engine.hf.ops import (
    apply_rope,
    attend,
    causal_conv,
    gated_rms_norm,
    join_state,
    rms_norm,
    rope_tables,
    routed_experts,
    split_state,
)
from kvreuse.engine.kernels import gated_scan
from kvreuse.engine.model import Context


class Granite(Family):
    def _dims(self) -> tuple[int, int, int, int, int, int]:
        c = self.c
        inner = int(c["mamba_expand"] * c["hidden_size"])
        heads, groups, n = c["mamba_n_heads"], c["mamba_n_groups"], c["mamba_d_state"]
        return inner, heads, groups, n, inner // heads, c["mamba_d_conv"]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        c, s = self.c, self.spec
        d, hd = s.hidden_size, s.head_dim
        nh, nkv = c["num_attention_heads"], s.num_key_value_heads
        out = {**self.head_shapes(), "model.norm.weight": (d,)}
        inner, heads, groups, n, _, k = self._dims()
        conv_dim = inner + 2 * groups * n
        for i, mixer in enumerate(s.mixers):
            p = f"model.layers.{i}"
            out[f"{p}.input_layernorm.weight"] = (d,)
            out[f"{p}.post_attention_layernorm.weight"] = (d,)
            m = c["shared_intermediate_size"]
            out[f"{p}.shared_mlp.input_linear.weight"] = (2 * m, d)
            out[f"{p}.shared_mlp.output_linear.weight"] = (d, m)
            e = c.get("num_local_experts") or 0
            if e:
                ie = c["intermediate_size"]
                out[f"{p}.block_sparse_moe.router.layer.weight"] = (e, d)
                out[f"{p}.block_sparse_moe.input_linear.weight"] = (e, 2 * ie, d)
                out[f"{p}.block_sparse_moe.output_linear.weight"] = (e, d, ie)
            if mixer == "mamba2":
                q = f"{p}.mamba"
                out[f"{q}.in_proj.weight"] = (inner + conv_dim + heads, d)
                out[f"{q}.conv1d.weight"] = (conv_dim, 1, k)
                for name in ("dt_bias", "A_log", "D"):
                    out[f"{q}.{name}"] = (heads,)
                out[f"{q}.norm.weight"] = (inner,)
                out[f"{q}.out_proj.weight"] = (d, inner)
                if c.get("mamba_conv_bias", True):
                    out[f"{q}.conv1d.bias"] = (conv_dim,)
                if c.get("mamba_proj_bias"):
                    out[f"{q}.in_proj.bias"] = (inner + conv_dim + heads,)
                    out[f"{q}.out_proj.bias"] = (d,)
            else:
                q = f"{p}.self_attn"
                for name, shape in (
                    ("q", (nh * hd, d)),
                    ("k", (nkv * hd, d)),
                    ("v", (nkv * hd, d)),
                ):
                    out[f"{q}.{name}_proj.weight"] = shape
                out[f"{q}.o_proj.weight"] = (d, nh * hd)
                if c.get("attention_bias"):
                    for name, size in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd), ("o", d)):
                        out[f"{q}.{name}_proj.bias"] = (size,)
        return out

    def embed(self, ids: Tensor) -> Tensor:
        return super().embed(ids) * self.c.get("embedding_multiplier", 1.0)

    def layer(self, i: int, x: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        p, eps = f"model.layers.{i}", self.c["rms_norm_eps"]
        res = self.c.get("residual_multiplier", 1.0)
        h = rms_norm(x, self.w[f"{p}.input_layernorm.weight"], eps)
        if self.spec.mixers[i] == "mamba2":
            h = ctx.scan(f"layers.{i}", lambda s0, want: self._mamba(i, h, s0, want))
        else:
            h = self._attention(i, h, pos, ctx)
        x = x + h * res
        h = rms_norm(x, self.w[f"{p}.post_attention_layernorm.weight"], eps)
        return x + self._ffn(p, h) * res

    def final(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.w["model.norm.weight"], self.c["rms_norm_eps"])

    def logits(self, h: Tensor) -> Tensor:
        return super().logits(h) / self.c.get("logits_scaling", 1.0)

    def _attention(self, i: int, h: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        p, n, hd = f"model.layers.{i}.self_attn", h.shape[0], self.spec.head_dim
        q = self._linear(f"{p}.q_proj", h).view(n, -1, hd)
        k = self._linear(f"{p}.k_proj", h).view(n, -1, hd)
        v = self._linear(f"{p}.v_proj", h).view(n, -1, hd)
        if self.c.get("position_embedding_type") == "rope":
            rope = self.c.get("rope_parameters") or {}
            angles = rope_tables(pos, hd, float(rope.get("rope_theta", 10000.0)))
            q, k = apply_rope(q, angles), apply_rope(k, angles)
        o = attend(ctx, f"layers.{i}", q, k, v, None, float(self.c["attention_multiplier"]))
        return self._linear(f"{p}.o_proj", o.reshape(n, -1))

    def _ffn(self, p: str, h: Tensor) -> Tensor:
        gate, up = (h @ self.w[f"{p}.shared_mlp.input_linear.weight"].T).chunk(2, dim=-1)
        out = (F.silu(gate) * up) @ self.w[f"{p}.shared_mlp.output_linear.weight"].T
        if not self.c.get("num_local_experts"):
            return out
        m = f"{p}.block_sparse_moe"
        logits = h @ self.w[f"{m}.router.layer.weight"].T
        top, index = logits.topk(self.c["num_experts_per_tok"], dim=-1)
        inp, outp = self.w[f"{m}.input_linear.weight"], self.w[f"{m}.output_linear.weight"]
        half = inp.shape[1] // 2
        experts = [(inp[e, :half], inp[e, half:], outp[e]) for e in range(inp.shape[0])]
        return out + routed_experts(h, index, torch.softmax(top, dim=-1), experts)

    def _mamba(
        self, i: int, h: Tensor, s0: Tensor | None, want: set[int]
    ) -> tuple[Tensor, dict[int, Tensor]]:
        p = f"model.layers.{i}.mamba"
        inner, heads, groups, n, d_head, _ = self._dims()
        L = h.shape[0]
        window, ssm = split_state(s0, self.spec.states[i])
        gate, xbc, dt = self._linear(f"{p}.in_proj", h).split(
            [inner, inner + 2 * groups * n, heads], dim=-1
        )
        conv, windows = causal_conv(
            xbc, window, self.w[f"{p}.conv1d.weight"], self.w.get(f"{p}.conv1d.bias"), want
        )
        xs, B, C = F.silu(conv).split([inner, groups * n, groups * n], dim=-1)
        lo, hi = _limits(self.c.get("time_step_limit"))
        dt = torch.clamp(F.softplus(dt + self.w[f"{p}.dt_bias"]), min=lo, max=hi)
        A = -torch.exp(self.w[f"{p}.A_log"])
        xs = xs.view(L, heads, d_head)
        rep = heads // groups
        B = B.view(L, groups, n).repeat_interleave(rep, dim=1)
        C = C.view(L, groups, n).repeat_interleave(rep, dim=1)
        y, _, states = gated_scan(C, B, xs * dt[..., None], dt * A, ssm.clone(), want)
        y = (y + self.w[f"{p}.D"][:, None] * xs).reshape(L, inner)
        y = gated_rms_norm(y, gate, self.w[f"{p}.norm.weight"], self.c["rms_norm_eps"], True)
        out = self._linear(f"{p}.out_proj", y)
        return out, {t: join_state(windows[t], states[t]) for t in want}


def _limits(value: object) -> tuple[float, float]:
    """time_step_limit as numbers: transformers writes infinity as {"__float__": "Infinity"}."""
    if not isinstance(value, list | tuple) or len(value) != 2:
        return 0.0, float("inf")
    out = [float(v["__float__"]) if isinstance(v, dict) else float(v) for v in value]
    return out[0], out[1]
