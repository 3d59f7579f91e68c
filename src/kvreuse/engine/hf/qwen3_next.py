"""Qwen3-Next (`qwen3_next`): gated DeltaNet layers and gated attention layers, each followed by
a sparse mixture of experts with a gated shared expert (a dense SwiGLU on `mlp_only_layers`).

    per layer: x += mixer(norm(x)) ; x += ffn(norm(x))        norms multiply by (1 + w)

Gated DeltaNet (state = conv window of the last k−1 q/k/v inputs + one matrix per value head):

    q, k, v, z = in_proj_qkvz(x) ; b, a = in_proj_ba(x)       interleaved per key head
    q, k, v = silu(conv1d(window ++ [q k v]))
    β = sigmoid(b), g = −exp(A_log) · softplus(a + dt_bias)
    q, k = l2norm(q) / √d_k, l2norm(k)                        (key heads repeated per value head)
    S ← exp(g) S ;  S ← S + k (β (v − Sᵀk))ᵀ ;  o = Sᵀ q       S: d_k × d_v per value head
    out = out_proj(RMSNorm(o) · silu(z))

Gated attention: q_proj yields the query and a gate per head; q and k are RMS-normalised per
head, RoPE turns only the first partial_rotary_factor · head_dim features, and the output is
multiplied by sigmoid(gate) before o_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from kvreuse.engine.hf.base import Family, attention_shapes
from kvreuse.engine.hf.ops import (
    apply_rope,
    attend,
    causal_conv,
    gated_rms_norm,
    join_state,
    rms_norm,
    rope_tables,
    routed_experts,
    silu_mlp,
    split_state,
)
from kvreuse.engine.model import Context


class Qwen3Next(Family):
    def _dims(self) -> tuple[int, int, int, int, int]:
        c = self.c
        return (
            c["linear_num_key_heads"],
            c["linear_num_value_heads"],
            c["linear_key_head_dim"],
            c["linear_value_head_dim"],
            c["linear_conv_kernel_dim"],
        )

    def _sparse(self, i: int) -> bool:
        c = self.c
        return (
            i not in (c.get("mlp_only_layers") or [])
            and c.get("num_experts", 0) > 0
            and (i + 1) % c.get("decoder_sparse_step", 1) == 0
        )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        c, s = self.c, self.spec
        d, hd = s.hidden_size, s.head_dim
        nh, nkv = c["num_attention_heads"], s.num_key_value_heads
        hk, hv, dk, dv, k = self._dims()
        out = {**self.head_shapes(), "model.norm.weight": (d,)}
        for i, mixer in enumerate(s.mixers):
            p = f"model.layers.{i}"
            out[f"{p}.input_layernorm.weight"] = (d,)
            out[f"{p}.post_attention_layernorm.weight"] = (d,)
            if mixer == "gated_deltanet":
                a = f"{p}.linear_attn"
                out[f"{a}.in_proj_qkvz.weight"] = (2 * hk * dk + 2 * hv * dv, d)
                out[f"{a}.in_proj_ba.weight"] = (2 * hv, d)
                out[f"{a}.conv1d.weight"] = (2 * hk * dk + hv * dv, 1, k)
                out[f"{a}.dt_bias"] = (hv,)
                out[f"{a}.A_log"] = (hv,)
                out[f"{a}.norm.weight"] = (dv,)
                out[f"{a}.out_proj.weight"] = (d, hv * dv)
            else:
                bias = bool(c.get("attention_bias"))
                heads = (nh, nkv, hd)
                out.update(attention_shapes(f"{p}.self_attn", d, heads, gated=True, bias=bias))
            out.update(self._ffn_shapes(i, f"{p}.mlp"))
        return out

    def _ffn_shapes(self, i: int, m: str) -> dict[str, tuple[int, ...]]:
        c, d = self.c, self.spec.hidden_size

        def mlp(prefix: str, size: int) -> dict[str, tuple[int, ...]]:
            return {
                f"{prefix}.gate_proj.weight": (size, d),
                f"{prefix}.up_proj.weight": (size, d),
                f"{prefix}.down_proj.weight": (d, size),
            }

        if not self._sparse(i):
            return mlp(m, c["intermediate_size"])
        out: dict[str, tuple[int, ...]] = {
            f"{m}.gate.weight": (c["num_experts"], d),
            f"{m}.shared_expert_gate.weight": (1, d),
        }
        out.update(mlp(f"{m}.shared_expert", c["shared_expert_intermediate_size"]))
        for e in range(c["num_experts"]):
            out.update(mlp(f"{m}.experts.{e}", c["moe_intermediate_size"]))
        return out

    def _norm(self, name: str, x: Tensor) -> Tensor:
        return rms_norm(x, self.w[name], self.c["rms_norm_eps"], offset=1.0)

    def layer(self, i: int, x: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        p = f"model.layers.{i}"
        h = self._norm(f"{p}.input_layernorm.weight", x)
        if self.spec.mixers[i] == "gated_deltanet":
            h = ctx.scan(f"layers.{i}", lambda s0, want: self._deltanet(i, h, s0, want))
        else:
            h = self._attention(i, h, pos, ctx)
        x = x + h
        return x + self._ffn(i, self._norm(f"{p}.post_attention_layernorm.weight", x))

    def final(self, x: Tensor) -> Tensor:
        return self._norm("model.norm.weight", x)

    def _mlp(self, prefix: str, h: Tensor) -> Tensor:
        w = self.w
        return silu_mlp(
            h,
            w[f"{prefix}.gate_proj.weight"],
            w[f"{prefix}.up_proj.weight"],
            w[f"{prefix}.down_proj.weight"],
        )

    def _ffn(self, i: int, h: Tensor) -> Tensor:
        m = f"model.layers.{i}.mlp"
        if not self._sparse(i):
            return self._mlp(m, h)
        probs = torch.softmax(h @ self.w[f"{m}.gate.weight"].T, dim=-1)
        top, index = probs.topk(self.c["num_experts_per_tok"], dim=-1)
        if self.c.get("norm_topk_prob", True):
            top = top / top.sum(dim=-1, keepdim=True)
        w = self.w
        experts = [
            (w[f"{x}.gate_proj.weight"], w[f"{x}.up_proj.weight"], w[f"{x}.down_proj.weight"])
            for x in (f"{m}.experts.{e}" for e in range(self.c["num_experts"]))
        ]
        out = routed_experts(h, index, top, experts)
        shared = torch.sigmoid(h @ self.w[f"{m}.shared_expert_gate.weight"].T)
        return out + shared * self._mlp(f"{m}.shared_expert", h)

    def _attention(self, i: int, h: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        p, n, hd = f"model.layers.{i}.self_attn", h.shape[0], self.spec.head_dim
        q, gate = self._linear(f"{p}.q_proj", h).view(n, -1, 2 * hd).chunk(2, dim=-1)
        q = self._norm(f"{p}.q_norm.weight", q)
        k = self._norm(f"{p}.k_norm.weight", self._linear(f"{p}.k_proj", h).view(n, -1, hd))
        v = self._linear(f"{p}.v_proj", h).view(n, -1, hd)
        rope = self.c.get("rope_parameters") or {}
        rotary = int(hd * float(rope.get("partial_rotary_factor", 1.0)))
        angles = rope_tables(pos, rotary, float(rope.get("rope_theta", 10000.0)))
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        o = attend(ctx, f"layers.{i}", q, k, v, None, hd**-0.5).reshape(n, -1)
        return self._linear(f"{p}.o_proj", o * torch.sigmoid(gate.reshape(n, -1)))

    def _deltanet(
        self, i: int, h: Tensor, s0: Tensor | None, want: set[int]
    ) -> tuple[Tensor, dict[int, Tensor]]:
        p, n = f"model.layers.{i}.linear_attn", h.shape[0]
        hk, hv, dk, dv, _ = self._dims()
        r = hv // hk
        window, state = split_state(s0, self.spec.states[i])
        qkvz = (h @ self.w[f"{p}.in_proj_qkvz.weight"].T).view(n, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = (h @ self.w[f"{p}.in_proj_ba.weight"].T).view(n, hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat((q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)), dim=-1)
        conv, windows = causal_conv(mixed, window, self.w[f"{p}.conv1d.weight"], None, want)
        q, k, v = F.silu(conv).split([hk * dk, hk * dk, hv * dv], dim=-1)
        q = _l2norm(q.view(n, hk, dk)).repeat_interleave(r, dim=1) / dk**0.5
        k = _l2norm(k.view(n, hk, dk)).repeat_interleave(r, dim=1)
        v = v.view(n, hv, dv)
        beta = torch.sigmoid(b.reshape(n, hv))
        g = -torch.exp(self.w[f"{p}.A_log"]) * F.softplus(a.reshape(n, hv) + self.w[f"{p}.dt_bias"])
        out, states = _delta_rule(q, k, v, g, beta, state.clone(), want)
        o = gated_rms_norm(
            out, z.reshape(n, hv, dv), self.w[f"{p}.norm.weight"], self.c["rms_norm_eps"], False
        )
        y = o.reshape(n, -1) @ self.w[f"{p}.out_proj.weight"].T
        return y, {t: join_state(windows[t], states[t]) for t in want}


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, want: set[int]
) -> tuple[Tensor, dict[int, Tensor]]:
    """The gated delta rule token by token: q/k [L, H, d_k], v [L, H, d_v], g/beta [L, H],
    state [H, d_k, d_v]. Returns the outputs [L, H, d_v] and the state after each count in
    `want`."""
    outs, states = [], {}
    decay = torch.exp(g)
    for t in range(q.shape[0]):
        state = state * decay[t][:, None, None]
        memory = torch.einsum("hkv,hk->hv", state, k[t])
        delta = (v[t] - memory) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t]))
        if t + 1 in want:
            states[t + 1] = state
    return torch.stack(outs), states
