"""Plain-torch pieces the Hugging Face families share: norms, RoPE (full or partial, and its
settings read from config.json in every layout `transformers` writes), the causal depthwise
convolution with its window, attention through the engine's context, and flat states.

Every function computes in float32 and follows the formula of the family's reference code
(the +1 weight offsets of Gemma 3 and Qwen3-Next norms, RoPE on the first `rotary_dim` features,
the zero left padding of a causal convolution), so the engine's logits can be compared with
`transformers`' own forward on the same checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvreuse.engine.model import Context
from kvreuse.hfconfig import Fields, is_number, show


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


ROPE_TYPES = ("default", "linear")  # the rope types the engine computes
ROPE_KEYS = ("full_attention", "sliding_attention")  # Gemma 3's nesting by layer type


@dataclass(frozen=True)
class Rope:
    """One attention layer kind's rotary embedding: base `theta`, `factor` (linear scaling
    divides the positions by it; 1 for default RoPE) and `fraction`, the share of each head's
    features that rotates (partial_rotary_factor)."""

    theta: float
    factor: float = 1.0
    fraction: float = 1.0


@dataclass(frozen=True)
class RopeDefaults:
    """What a family's RoPE is when config.json leaves it out. `theta`: per layer kind, the
    default base and the transformers-4 top-level key that sets it (Gemma 3: `rope_theta` for
    full attention, `rope_local_base_freq` for sliding; "" is a flat family's one set).
    `fraction`: the default partial_rotary_factor, or None where the family always rotates the
    whole head (a value other than 1 is then refused)."""

    theta: dict[str, tuple[float, str]]
    fraction: float | None = None


def read_rope(f: Fields, defaults: RopeDefaults) -> dict[str, Rope]:
    """The RoPE of each layer kind from config.json, in any layout `transformers` writes:

    * transformers 5: `rope_parameters` = {"rope_type", "rope_theta", "factor",
      "partial_rotary_factor"}, or nested per layer type (Gemma 3: {"full_attention": {...},
      "sliding_attention": {...}});
    * transformers 4: top-level `rope_theta` (Gemma 3: and `rope_local_base_freq`) with
      `rope_scaling` = {"type" or "rope_type", "factor"} (Gemma 3: for full attention only)
      and a top-level `partial_rotary_factor`.

    A value given in two layouts must agree; a rope type other than default or linear is
    refused, naming the field."""
    params = _rope_object(f, "rope_parameters")
    scaling = _rope_object(f, "rope_scaling")
    nested = list(defaults.theta) != [""]
    if nested:
        flat = sorted(k for k in params if k not in ROPE_KEYS)
        if flat:
            f.fail(
                "rope_parameters",
                f"has {flat[0]!r}: {f.d.get('model_type')} nests it by "
                f"layer type ({', '.join(ROPE_KEYS)})",
            )
    elif any(isinstance(v, dict) for v in params.values()):
        f.fail("rope_parameters", f"is nested by layer type; {f.d.get('model_type')} takes one set")
    out = {}
    for kind, (theta, top_key) in defaults.theta.items():
        label = f"rope_parameters[{kind!r}]" if nested else "rope_parameters"
        entry = params.get(kind) if nested else params
        if entry is not None and not isinstance(entry, dict):
            f.fail(label, f"must be an object, got {show(entry)}")
        # transformers 4's rope_scaling is the (Gemma 3: full-attention) scaling
        extra = scaling if kind in ("", "full_attention") else {}
        keys = _merge(f, entry or {}, label, extra)
        out[kind] = _rope_entry(f, keys, theta, top_key, defaults.fraction)
    return out


def _rope_object(f: Fields, key: str) -> dict[str, Any]:
    v = f.d.get(key)
    if v is not None and not isinstance(v, dict):
        f.fail(key, f"must be an object or null, got {show(v)}")
    return v or {}


def _merge(
    f: Fields, entry: dict[str, Any], label: str, scaling: dict[str, Any]
) -> dict[str, tuple[Any, str]]:
    """One kind's RoPE keys, each with the field it came from; rope_scaling's must agree."""
    out = {k: (v, f"{label}.{k}") for k, v in entry.items()}
    for k, v in scaling.items():
        if k in out and out[k][0] != v:
            f.fail(f"rope_scaling.{k}", f"is {show(v)} but {out[k][1]} is {show(out[k][0])}")
        out[k] = (v, f"rope_scaling.{k}")
    return out


def _rope_entry(
    f: Fields,
    keys: dict[str, tuple[Any, str]],
    theta: float,
    top_key: str,
    partial: float | None,
) -> Rope:
    """One layer kind's Rope from its keys (each with the field it came from), the top-level
    key and default of its base, and the family's default partial_rotary_factor (None: 1
    only)."""
    kind, kind_field = _rope_type(f, keys)
    base = _agreeing(f, keys, "rope_theta", top_key, theta)
    key = "partial_rotary_factor"
    fraction = _agreeing(f, keys, key, key, 1.0 if partial is None else partial)
    name = keys.get(key, (None, key))[1]
    if not 0 < fraction <= 1:
        f.fail(name, f"must be in (0, 1], got {fraction}")
    if partial is None and fraction != 1:
        f.fail(name, f"is {fraction}: {f.d.get('model_type')} turns the whole head (1.0 only)")
    if not base > 0:
        f.fail(keys.get("rope_theta", (None, top_key))[1], f"must be > 0, got {base}")
    factor = 1.0
    if kind == "linear":
        # a missing factor belongs where the rope type was given
        value, where = keys.get("factor", (None, kind_field.rsplit(".", 1)[0] + ".factor"))
        if not is_number(value) or not value > 0:
            f.fail(where, f"must be a number > 0 for linear RoPE, got {show(value)}")
        factor = float(value)
    return Rope(base, factor, fraction)


def _rope_type(f: Fields, keys: dict[str, tuple[Any, str]]) -> tuple[str, str]:
    """`rope_type`, or transformers 4's `type`: default or linear (anything else refused)."""
    named = [keys[k] for k in ("rope_type", "type") if k in keys and keys[k][0] is not None]
    if len(named) == 2 and named[0][0] != named[1][0]:
        f.fail(named[1][1], f"is {show(named[1][0])} but {named[0][1]} is {show(named[0][0])}")
    value, where = named[0] if named else ("default", "rope_type")
    if not isinstance(value, str) or value not in ROPE_TYPES:
        f.fail(
            where,
            f"{show(value)} is not supported; the engine runs RoPE types {', '.join(ROPE_TYPES)}",
        )
    return value, where


def _agreeing(
    f: Fields, keys: dict[str, tuple[Any, str]], key: str, top: str, default: float
) -> float:
    """`key` of the RoPE entry or transformers 4's top-level `top` (both: they must agree)."""
    inner = keys.get(key)
    given = [(v, where) for v, where in (inner or (None, ""), (f.d.get(top), top)) if v is not None]
    for v, where in given:
        if not is_number(v):
            f.fail(where, f"must be a finite number, got {show(v)}")
    if len(given) == 2 and given[0][0] != given[1][0]:
        f.fail(top, f"is {show(given[1][0])} but {given[0][1]} is {show(given[0][0])}")
    return float(given[0][0]) if given else default


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
