"""Plain-torch kernels: RMSNorm, RoPE, partial attention with log-sum-exp, the gated scan.

Partial attention returns `(out, lse)` so that attention over a key set split into disjoint
shares (one per DCP rank) can be merged exactly:

    lse   = logsumexp_r lse_r
    out   = sum_r exp(lse_r - lse) * out_r

A share with no visible key for some query has lse_r = -inf and weight 0.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NEG_INF = float("-inf")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate-half RoPE. x: [L, H, D], positions: [L] absolute token positions."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = (positions.to(torch.float64)[:, None] * inv[None, :]).to(x.dtype)
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def attention_partial(
    q: Tensor, qpos: Tensor, k: Tensor, v: Tensor, kpos: Tensor, window: int | None
) -> tuple[Tensor, Tensor]:
    """Causal (optionally windowed) GQA attention of q over one share of the keys.

    q: [Lq, H, D], k/v: [Lk, Hkv, D]. A query at p sees keys at kp with kp <= p and, with a
    window W, kp > p - W. Returns out [Lq, H, D] and lse [Lq, H].
    """
    lq, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qh = q.reshape(lq, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, g, Lq, D]
    s = torch.einsum("hgqd,khd->hgqk", qh, k) / math.sqrt(d)
    mask = kpos[None, :] <= qpos[:, None]
    if window is not None:
        mask &= kpos[None, :] > qpos[:, None] - window
    s = s.masked_fill(~mask, NEG_INF)
    lse = torch.logsumexp(s, dim=-1)  # -inf where a query sees nothing in this share
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("hgqk,khd->hgqd", p, v)
    return out.permute(2, 0, 1, 3).reshape(lq, h, d), lse.permute(2, 0, 1).reshape(lq, h)


def merge_partials(parts: list[tuple[Tensor, Tensor]]) -> Tensor:
    if len(parts) == 1:
        return parts[0][0]
    outs = torch.stack([o for o, _ in parts])  # [R, Lq, H, D]
    lses = torch.stack([s for _, s in parts])  # [R, Lq, H]
    total = torch.logsumexp(lses, dim=0)
    w = torch.exp(lses - total[None])  # exp(-inf) = 0 for empty shares
    return (w[..., None] * outs).sum(0)


def gated_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Tensor,
    state: Tensor,
    want: set[int],
    chunk: int = 128,
) -> tuple[Tensor, Tensor, dict[int, Tensor]]:
    """The gated linear recurrence  S_t = a_t S_{t-1} + k_t^T v_t,  o_t = q_t S_t.

    q/k: [L, H, dk], v: [L, H, dv], log_decay = log a_t: [L, H] (<= 0), state: [H, dk, dv].
    Computed chunk by chunk in the parallel (attention-like) form; within a chunk
    S_t = exp(c_t) S_0 + sum_{s<=t} exp(c_t - c_s) k_s^T v_s  with c the cumulative log decay.
    Returns outputs [L, H, dv], the final state, and the state after i tokens for i in `want`
    (1 <= i <= L).
    """
    outs, states = [], {}
    n = q.shape[0]
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        qc, kc, vc = q[a:b], k[a:b], v[a:b]
        cum = torch.cumsum(log_decay[a:b], dim=0)  # [l, H]
        diff = cum[:, None, :] - cum[None, :, :]  # [t, s, H]
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        w = torch.exp(diff.masked_fill(~causal[..., None], NEG_INF))
        qk = torch.einsum("thd,shd->tsh", qc, kc)
        intra = torch.einsum("tsh,she->the", w * qk, vc)
        inter = torch.exp(cum)[..., None] * torch.einsum("thd,hde->the", qc, state)
        outs.append(intra + inter)
        for i in sorted(x for x in want if a < x <= b):
            states[i] = _state_at(cum, kc, vc, state, i - a - 1)
        state = _state_at(cum, kc, vc, state, b - a - 1)
    return torch.cat(outs), state, states


def _state_at(cum: Tensor, k: Tensor, v: Tensor, s0: Tensor, t: int) -> Tensor:
    ws = torch.exp(cum[t][None, :] - cum[: t + 1])  # [s, H]
    add = torch.einsum("sh,shd,she->hde", ws, k[: t + 1], v[: t + 1])
    return torch.exp(cum[t])[:, None, None] * s0 + add
