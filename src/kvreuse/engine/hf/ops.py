"""Plain-torch pieces the Hugging Face families share: norms, RoPE (full or partial), the causal
depthwise convolution with its window, attention through the engine's context, and flat states.

Every function computes in float32 and follows the formula of the family's reference code
(the +1 weight offsets of Gemma 3 and Qwen3-Next norms, RoPE on the first `rotary_dim` features,
the zero left padding of a causal convolution), so the engine's logits can be compared with
`transformers`' own forward on the same checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor

from kvreuse.engine.model import Context


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """RMSNorm; `offset` 1.0 for the families that store the weight as w − 1 (x · (1 + w))."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (offset + weight)


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float, gate_first: bool) -> Tensor:
    """Mamba-2's norm gates before normalising (x · silu(z), then RMSNorm); gated DeltaNet's
    normalises first and gates after."""
    if gate_first:
        return rms_norm(x * F.silu(gate), weight, eps)
    return rms_norm(x, weight, eps) * F.silu(gate)


def rope_tables(positions: Tensor, rotary_dim: int, theta: float, factor: float = 1.0) -> Tensor:
    """The angles [L, rotary_dim / 2] of default RoPE (linear scaling divides them by
    `factor`), computed as the reference does: float32 inverse frequencies times positions."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    return positions.to(torch.float32)[:, None] * (inv / factor)[None, :]


def apply_rope(x: Tensor, angles: Tensor) -> Tensor:
    """Rotate-half RoPE on the first 2 · angles.shape[-1] features of x [L, H, D]; the rest
    pass through (partial rotary)."""
    half = angles.shape[-1]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    cos, sin = emb.cos(), emb.sin()
    x1, x2 = rot[..., :half], rot[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)


def attend(
    ctx: Context, layer: str, q: Tensor, k: Tensor, v: Tensor, window: int | None, scale: float
) -> Tensor:
    """Attention through the engine's context (paged, DCP ranks merged by log-sum-exp, or
    dense) with the family's score scale: the context divides by √head_dim, so q is scaled to
    give q·k · scale."""
    return ctx.attend(layer, q * (scale * math.sqrt(q.shape[-1])), k, v, window)


def causal_conv(
    x: Tensor, window: Tensor, weight: Tensor, bias: Tensor | None, want: Iterable[int]
) -> tuple[Tensor, dict[int, Tensor]]:
    """Depthwise causal convolution of x [L, C] continuing from `window` [k−1, C], the inputs
    before x (zeros at the start of a sequence: the reference's left padding). `weight` is the
    checkpoint's [C, 1, k]. Returns the outputs [L, C] (before any activation) and, for each
    count t in `want` (1 ≤ t ≤ L), the window after t tokens: the last k−1 inputs."""
    k = weight.shape[-1]
    full = torch.cat((window, x))  # row j is the input at relative position j − (k − 1)
    out = F.conv1d(full.T[None], weight, bias, groups=x.shape[1])[0].T
    return out, {t: full[t : t + k - 1] for t in want}


def split_state(
    flat: Tensor | None, parts: tuple[tuple[str, tuple[int, ...]], ...]
) -> list[Tensor]:
    """A flat state row as its parts (zeros when None: a sequence's start)."""
    if flat is None:
        return [torch.zeros(shape) for _, shape in parts]
    out, at = [], 0
    for _, shape in parts:
        n = math.prod(shape)
        out.append(flat[at : at + n].view(shape))
        at += n
    return out


def join_state(*tensors: Tensor) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def silu_mlp(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def routed_experts(
    x: Tensor, index: Tensor, weight: Tensor, experts: list[tuple[Tensor, Tensor, Tensor]]
) -> Tensor:
    """Σ over the chosen experts of weight · SwiGLU_e(x): each token runs only its top-k
    experts (index, weight: [L, k]); `experts[e]` = (gate, up, down) weights."""
    out = torch.zeros_like(x)
    for e in torch.unique(index).tolist():
        rows, slot = torch.where(index == e)
        gate, up, down = experts[e]
        y = silu_mlp(x[rows], gate, up, down) * weight[rows, slot, None]
        out.index_add_(0, rows, y)
    return out
