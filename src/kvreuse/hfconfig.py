"""A Hugging Face checkpoint's `config.json`, read into what the cache needs to know (torch-free).

For each supported family, which layer is which mixer, which cache group kind each mixer maps to,
the attention windows and KV shapes, and the shape and size of every recurrent state:

    family (model_type)               mixer            kind        state per layer and request
    Granite-4.0-H (granitemoehybrid)  mamba2           recurrent   conv window (k−1) × conv_dim
                                                                   + SSM heads × d_state × d_head
                                      attention        full        —
    Gemma 3 (gemma3_text)             sliding attn     sliding     —
                                      attention        full        —
    LFM2 (lfm2)                       short_conv       recurrent   conv window (L−1) × hidden
                                      attention        full        —
    Qwen3-Next (qwen3_next)           gated_deltanet   recurrent   conv window (k−1) × conv_dim
                                                                   + matrix v_heads × d_k × d_v
                                      gated attention  full        —

`geometry_toml` turns a spec into a geometry file (`kvreuse geometry from-model DIR`), so the
simulator, sweeps and the qualifier run on a real model's groups. The engine reads the same spec
(`kvreuse.engine.hf`), so the two never disagree about which layer is in which group.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# model_type -> family name (the engine module that runs it)
FAMILIES: dict[str, str] = {
    "granitemoehybrid": "granite",
    "gemma3_text": "gemma3",
    "lfm2": "lfm2",
    "qwen3_next": "qwen3_next",
}
# config.json layer type -> (mixer, group kind), per family
LAYER_TYPES: dict[str, dict[str, tuple[str, str]]] = {
    "granite": {
        "mamba": ("mamba2", "recurrent"),
        "linear_attention": ("mamba2", "recurrent"),
        "attention": ("attention", "full"),
        "full_attention": ("attention", "full"),
    },
    "gemma3": {
        "sliding_attention": ("attention", "sliding"),
        "full_attention": ("attention", "full"),
    },
    "lfm2": {"conv": ("short_conv", "recurrent"), "full_attention": ("attention", "full")},
    "qwen3_next": {
        "linear_attention": ("gated_deltanet", "recurrent"),
        "full_attention": ("attention", "full"),
    },
}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ModelSpec:
    """What the cache needs of a checkpoint. `states[i]` names the parts of layer i's recurrent
    state and their shapes, in the order the engine lays them out in one flat state row."""

    model_type: str
    family: str
    layer_kinds: tuple[str, ...]  # per layer: "full" | "sliding" | "recurrent"
    mixers: tuple[str, ...]  # per layer: "attention" | "mamba2" | "short_conv" | ...
    vocab_size: int
    hidden_size: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    sliding_window: int | None
    dtype_bytes: int  # the checkpoint's parameter dtype (the engine itself computes in float32)
    states: dict[int, tuple[tuple[str, tuple[int, ...]], ...]] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == kind]

    def state_numel(self, layer: int) -> int:
        return sum(math.prod(shape) for _, shape in self.states[layer])

    def kv_bytes_per_token(self) -> int:
        """K and V of one token in one attention layer, in the checkpoint's dtype."""
        return 2 * self.num_key_value_heads * self.head_dim * self.dtype_bytes


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: missing (a model directory needs config.json)")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return d


def is_hf_config(d: dict[str, Any]) -> bool:
    """A config of one of the supported Hugging Face families (not kvreuse's own tiny model)."""
    return d.get("model_type") in FAMILIES


def _get(d: dict[str, Any], key: str, where: str, kind: type = int) -> Any:
    if key not in d or d[key] is None:
        raise ValueError(f"{where}: {key} is missing")
    v = d[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(f"{where}: {key} must be an int ≥ 1, got {v!r}")
    return v


def model_spec(d: dict[str, Any], where: str = "config.json") -> ModelSpec:
    """The spec of a supported family's config (ValueError naming the key otherwise)."""
    mt = d.get("model_type")
    if mt not in FAMILIES:
        raise ValueError(
            f"{where}: model_type {mt!r} is not supported; supported: {sorted(FAMILIES)} "
            "(or kvreuse's own 'kvreuse-tiny')"
        )
    family = FAMILIES[mt]
    n = _get(d, "num_hidden_layers", where)
    types = d.get("layer_types") or d.get("layers_block_type")
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"{where}: layer_types must list {n} layer types, got {types!r}")
    table = LAYER_TYPES[family]
    bad = sorted({t for t in types if t not in table})
    if bad:
        raise ValueError(f"{where}: unknown layer_types {bad}; {mt} allows {sorted(table)}")
    hidden = _get(d, "hidden_size", where)
    heads = _get(d, "num_attention_heads", where)
    head_dim = d.get("head_dim") or hidden // heads
    kinds = tuple(table[t][1] for t in types)
    window = d.get("sliding_window") if "sliding" in kinds else None
    if "sliding" in kinds and (not isinstance(window, int) or window < 2):
        raise ValueError(f"{where}: sliding layers need sliding_window ≥ 2, got {window!r}")
    dtype = str(d.get("dtype") or d.get("torch_dtype") or "float32")
    spec = ModelSpec(
        model_type=mt,
        family=family,
        layer_kinds=kinds,
        mixers=tuple(table[t][0] for t in types),
        vocab_size=_get(d, "vocab_size", where),
        hidden_size=hidden,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=_get(d, "max_position_embeddings", where),
        sliding_window=window,
        dtype_bytes=DTYPE_BYTES.get(dtype, 4),
        raw=d,
    )
    for i, mixer in enumerate(spec.mixers):
        if mixer != "attention":
            spec.states[i] = _state_parts(mixer, d, hidden, where)
    return spec


def _state_parts(
    mixer: str, d: dict[str, Any], hidden: int, where: str
) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The parts of one recurrent layer's state: a conv window of the last k−1 conv inputs
    (always), then the SSM or delta-rule matrix where the mixer has one."""
    if mixer == "mamba2":
        heads, groups = _get(d, "mamba_n_heads", where), _get(d, "mamba_n_groups", where)
        d_state, k = _get(d, "mamba_d_state", where), _get(d, "mamba_d_conv", where)
        inner = int(_get(d, "mamba_expand", where) * hidden)
        d_head = d.get("mamba_d_head")
        d_head = inner // heads if d_head in (None, "auto") else int(d_head)
        conv_dim = inner + 2 * groups * d_state
        return (("conv", (k - 1, conv_dim)), ("ssm", (heads, d_state, d_head)))
    if mixer == "short_conv":
        return (("conv", (_get(d, "conv_L_cache", where) - 1, hidden)),)
    # gated DeltaNet
    hk, hv = _get(d, "linear_num_key_heads", where), _get(d, "linear_num_value_heads", where)
    dk, dv = _get(d, "linear_key_head_dim", where), _get(d, "linear_value_head_dim", where)
    k = _get(d, "linear_conv_kernel_dim", where)
    return (("conv", (k - 1, 2 * hk * dk + hv * dv)), ("matrix", (hv, dk, dv)))


def read_model_spec(directory: str | Path) -> ModelSpec:
    return model_spec(read_config(directory), str(Path(directory) / "config.json"))


@dataclass(frozen=True)
class GeometryOptions:
    """The deployment choices a checkpoint does not fix: DCP ranks, the attention groups' local
    block, the recurrent group's state spacing M, and the pool (capacity or blocks)."""

    dcp_size: int = 1
    block_size: int = 16
    state_block_size: int | None = None  # default: the attention page (block_size × dcp)
    capacity_tokens: int | None = 16384
    num_blocks: int | None = None
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings


def geometry_toml(spec: ModelSpec, opts: GeometryOptions | None = None, name: str = "") -> str:
    """A geometry file for the model: one group per layer kind it has (full, then sliding, then
    recurrent), with comments naming each group's layers and their sizes in bytes."""
    o = opts or GeometryOptions()
    for key in ("dcp_size", "block_size", "max_num_batched_tokens"):
        if not isinstance(getattr(o, key), int) or getattr(o, key) < 1:
            raise ValueError(f"{key} must be an int ≥ 1, got {getattr(o, key)!r}")
    if o.num_blocks is not None and o.capacity_tokens is not None:
        raise ValueError("give num_blocks or capacity_tokens, not both")
    page = o.block_size * o.dcp_size
    state_block = o.state_block_size or page
    kv = spec.kv_bytes_per_token()
    lines = [
        f"# {name or spec.model_type}: {len(spec.layer_kinds)} layers of {spec.model_type} "
        f"({', '.join(f'{spec.mixers.count(m)} {m}' for m in dict.fromkeys(spec.mixers))})",
        f"# KV per token per attention layer: {kv:,} bytes ({spec.num_key_value_heads} KV heads "
        f"× {spec.head_dim} dims × 2 × {spec.dtype_bytes} bytes)",
        "[cache]",
        f"dcp_size = {o.dcp_size}",
    ]
    if o.num_blocks is not None:
        lines.append(f"num_blocks = {o.num_blocks}")
    else:
        lines.append(f"capacity_tokens = {o.capacity_tokens or spec.max_position_embeddings}")
    lines.append(f"max_num_batched_tokens = {o.max_num_batched_tokens}")
    lines.append(f"max_model_len = {o.max_model_len or spec.max_position_embeddings}")
    for kind in ("full", "sliding", "recurrent"):
        layers = spec.layers_of(kind)
        if not layers:
            continue
        lines.append("")
        lines.append(
            f"# layers {', '.join(map(str, layers))}: {_group_note(spec, kind, layers, o)}"
        )
        lines.append("[[groups]]")
        lines.append(f'kind = "{kind}"')
        lines.append(f"block_size = {state_block if kind == 'recurrent' else o.block_size}")
        if kind == "sliding":
            lines.append(f"window = {spec.sliding_window}")
    return "\n".join(lines) + "\n"


def model_geometry(directory: Path, opts: GeometryOptions | None = None) -> str:
    """The geometry file of the model in `directory` (ValueError naming what is wrong)."""
    try:
        spec = read_model_spec(directory)
    except ValueError as exc:
        raise ValueError(
            f"{directory}: not a model directory kvreuse can derive a geometry from: {exc}"
        ) from None
    return geometry_toml(spec, opts, directory.name)


def _group_note(spec: ModelSpec, kind: str, layers: list[int], o: GeometryOptions) -> str:
    kv = spec.kv_bytes_per_token()
    if kind == "full":
        return (
            f"full attention, DCP-sharded over {o.dcp_size} rank(s); one block is "
            f"{o.block_size * kv:,} bytes per layer per rank"
        )
    if kind == "sliding":
        return (
            f"sliding-window attention (window {spec.sliding_window}); one block is "
            f"{o.block_size * kv:,} bytes per layer"
        )
    parts = {spec.mixers[i] for i in layers}
    sizes = sorted({spec.state_numel(i) * spec.dtype_bytes for i in layers})
    what = "; ".join(
        f"{name} {' × '.join(map(str, shape))}" for name, shape in spec.states[layers[0]]
    )
    return (
        f"{', '.join(sorted(parts))} state ({what}): "
        f"{', '.join(f'{s:,}' for s in sizes)} bytes per layer"
    )
