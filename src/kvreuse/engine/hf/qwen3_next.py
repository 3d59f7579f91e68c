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

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from kvreuse.engine.hf.base import Family, Want, attention_shapes, rotary_dim, silu_only
from kvreuse.engine.hf.ops import (
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
    silu_mlp,
    split_state,
)
from kvreuse.engine.model import Context
from kvreuse.hfconfig import Fields

# Fields of Qwen3NextConfig and what becomes of each (besides those of Family and ModelSpec,
# which reads the linear_* sizes, and full_attention_interval where layer_types is absent):
#   read: rms_norm_eps, attention_bias, num_experts, decoder_sparse_step, mlp_only_layers
#     (which layers are sparse), num_experts_per_tok, norm_topk_prob, moe_intermediate_size,
#     shared_expert_intermediate_size (sparse layers), intermediate_size (dense layers), the
#     RoPE (rope_parameters, or rope_theta / rope_scaling / partial_rotary_factor; a quarter of
#     each head rotates by default), tie_word_embeddings (default false)
#   refused unless the default: hidden_act (silu)
#   ignored: output_router_logits, router_aux_loss_coef (the training loss)
ROPE = RopeDefaults({"": (1e4, "rope_theta")}, fraction=0.25)


class Qwen3Next(Family):
    STRUCTURE = (
        "num_hidden_layers, layer_types, num_experts, decoder_sparse_step, mlp_only_layers, "
        "attention_bias, tie_word_embeddings"
    )

    def read(self, f: Fields) -> None:
        silu_only(f)
        n = len(self.spec.layer_kinds)
        self.eps = f.number("rms_norm_eps", 1e-6, above=0)
        self.bias = f.flag("attention_bias", False)
        experts = f.integer("num_experts", lo=0)
        step = f.integer("decoder_sparse_step", 1)
        dense_only = set(f.integers("mlp_only_layers", n) or ())
        self.sparse = [
            i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(n)
        ]
        self.experts = experts
        if any(self.sparse):
            self.top_k = f.integer("num_experts_per_tok", 10, hi=experts)
            self.norm_topk = f.flag("norm_topk_prob", True)
            self.expert_ff = f.integer("moe_intermediate_size")
            self.shared_ff = f.integer("shared_expert_intermediate_size")
        if not all(self.sparse):
            self.ff = f.integer("intermediate_size")
        self.rope = read_rope(f, ROPE)[""]
        self.rotary = rotary_dim(f, self.spec.head_dim, self.rope.fraction)
        if "gated_deltanet" in self.spec.mixers:  # sizes ModelSpec has checked
            self.dims = (
                f.integer("linear_num_key_heads"),
                f.integer("linear_num_value_heads"),
                f.integer("linear_key_head_dim"),
                f.integer("linear_value_head_dim"),
                f.integer("linear_conv_kernel_dim"),
            )

    def shapes(self) -> Iterator[Want]:
        s = self.spec
        d, hd = s.hidden_size, s.head_dim
        yield from self.head_shapes()
        yield "model.norm.weight", (d,), "hidden_size"
        for i, mixer in enumerate(s.mixers):
            p = f"model.layers.{i}"
            yield f"{p}.input_layernorm.weight", (d,), "hidden_size"
            yield f"{p}.post_attention_layernorm.weight", (d,), "hidden_size"
            if mixer == "gated_deltanet":
                yield from self._deltanet_shapes(f"{p}.linear_attn")
            else:
                heads = (s.num_attention_heads, s.num_key_value_heads, hd)
                a = f"{p}.self_attn"
                yield from attention_shapes(a, d, heads, gated=True, bias=self.bias)
            yield from self._ffn_shapes(i, f"{p}.mlp")

    def _deltanet_shapes(self, a: str) -> Iterator[Want]:
        d = self.spec.hidden_size
        hk, hv, dk, dv, k = self.dims
        why = "linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, "
        why += "linear_value_head_dim"
        yield f"{a}.in_proj_qkvz.weight", (2 * hk * dk + 2 * hv * dv, d), f"hidden_size, {why}"
        yield f"{a}.in_proj_ba.weight", (2 * hv, d), "hidden_size, linear_num_value_heads"
        yield f"{a}.conv1d.weight", (2 * hk * dk + hv * dv, 1, k), f"{why}, linear_conv_kernel_dim"
        yield f"{a}.dt_bias", (hv,), "linear_num_value_heads"
        yield f"{a}.A_log", (hv,), "linear_num_value_heads"
        yield f"{a}.norm.weight", (dv,), "linear_value_head_dim"
        yield f"{a}.out_proj.weight", (d, hv * dv), f"hidden_size, {why}"

    def _ffn_shapes(self, i: int, m: str) -> Iterator[Want]:
        d = self.spec.hidden_size

        def mlp(prefix: str, size: int, why: str) -> Iterator[Want]:
            yield f"{prefix}.gate_proj.weight", (size, d), f"hidden_size, {why}"
            yield f"{prefix}.up_proj.weight", (size, d), f"hidden_size, {why}"
            yield f"{prefix}.down_proj.weight", (d, size), f"hidden_size, {why}"

        # which layers are sparse follows num_experts, decoder_sparse_step and mlp_only_layers
        which = "num_experts, decoder_sparse_step, mlp_only_layers"
        if not self.sparse[i]:
            yield from mlp(m, self.ff, f"intermediate_size (a dense layer: {which})")
            return
        yield f"{m}.gate.weight", (self.experts, d), f"hidden_size ({which})"
        yield f"{m}.shared_expert_gate.weight", (1, d), f"hidden_size ({which})"
        yield from mlp(
            f"{m}.shared_expert", self.shared_ff, f"shared_expert_intermediate_size ({which})"
        )
        for e in range(self.experts):
            yield from mlp(f"{m}.experts.{e}", self.expert_ff, f"moe_intermediate_size ({which})")

    def _norm(self, name: str, x: Tensor) -> Tensor:
        return rms_norm(x, self.w[name], self.eps, offset=1.0)

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
        if not self.sparse[i]:
            return self._mlp(m, h)
        probs = torch.softmax(h @ self.w[f"{m}.gate.weight"].T, dim=-1)
        top, index = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        w = self.w
        experts = [
            (w[f"{x}.gate_proj.weight"], w[f"{x}.up_proj.weight"], w[f"{x}.down_proj.weight"])
            for x in (f"{m}.experts.{e}" for e in range(self.experts))
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
        angles = rope_tables(pos, self.rotary, self.rope.theta, self.rope.factor)
        q, k = apply_rope(q, angles), apply_rope(k, angles)
        o = attend(ctx, f"layers.{i}", q, k, v, None, hd**-0.5).reshape(n, -1)
        return self._linear(f"{p}.o_proj", o * torch.sigmoid(gate.reshape(n, -1)))

    def _deltanet(
        self, i: int, h: Tensor, s0: Tensor | None, want: set[int]
    ) -> tuple[Tensor, dict[int, Tensor]]:
        p, n = f"model.layers.{i}.linear_attn", h.shape[0]
        hk, hv, dk, dv, _ = self.dims
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
        o = gated_rms_norm(out, z.reshape(n, hv, dv), self.w[f"{p}.norm.weight"], self.eps, False)
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
