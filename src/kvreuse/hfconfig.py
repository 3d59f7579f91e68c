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
(`kvreuse.engine.hf`), so the two never disagree about which layer is in which group. Fields are
read through `Fields`: each refusal is a one-line `CheckpointError` naming the field.
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

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
# No real model comes near these. They bound what a config.json alone makes kvreuse build (the
# layer list, the geometry's sizes) before any weights are there to compare it with.
MAX_LAYERS = 1 << 16
MAX_SIZE = 1 << 40


class CheckpointError(ValueError):
    """A config.json (or the weights beside it) that kvreuse cannot read or the engine cannot
    run: one line naming the file and the field or tensor, and what is allowed."""


REQUIRED: Any = object()  # a field with no default: it must be in config.json


_SHORT = reprlib.Repr()
_SHORT.maxlist = _SHORT.maxdict = 4
_SHORT.maxstring = _SHORT.maxother = _SHORT.maxlong = 40


def show(value: Any) -> str:
    """A config value for a one-line message: a repr (which escapes newlines) cut short, and
    built short, so a list of a million layer types costs nothing to name."""
    text = _SHORT.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def is_number(v: Any) -> bool:
    """A finite JSON number (not a bool; an integer too large for a float is not finite)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


class Fields:
    """Typed reads of one config.json. A field that is absent or null takes the value
    `transformers` gives it when absent (`default`; REQUIRED: there is none, it must be there);
    each refusal is one line naming the field and what it may be."""

    def __init__(self, d: dict[str, Any], where: str) -> None:
        self.d = d
        self.where = where

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def fail(self, key: str, problem: str) -> NoReturn:
        raise CheckpointError(f"{self.where}: {key} {problem}")

    def _value(self, key: str, default: Any) -> Any:
        if self.has(key):
            return self.d[key]
        if default is REQUIRED:
            self.fail(key, "is missing")
        return default

    def integer(self, key: str, default: Any = REQUIRED, lo: int = 1, hi: int = MAX_SIZE) -> int:
        v = self._value(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            top = "" if hi == MAX_SIZE else f" and ≤ {hi:,}"
            self.fail(key, f"must be an integer ≥ {lo}{top}, got {show(v)}")
        return v

    def number(self, key: str, default: Any = REQUIRED, above: float | None = None) -> float:
        """A finite number (`above`: greater than this)."""
        v = self._value(key, default)
        if not is_number(v):
            self.fail(key, f"must be a finite number, got {show(v)}")
        if above is not None and not v > above:
            self.fail(key, f"must be > {above}, got {show(v)}")
        return float(v)

    def flag(self, key: str, default: bool) -> bool:
        v = self._value(key, default)
        if not isinstance(v, bool):
            self.fail(key, f"must be true or false, got {show(v)}")
        return v

    def integers(self, key: str, n: int) -> list[int] | None:
        """A list of layer indices (each in [0, n)), or None when absent."""
        v = self.d.get(key)
        if v is None:
            return None
        # type(i) is int: a bool is not a layer index
        if not isinstance(v, list) or not all(type(i) is int and 0 <= i < n for i in v):
            self.fail(key, f"must list layer indices in [0, {n}), got {show(v)}")
        return v


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
    num_attention_heads: int = 0
    layer_types: tuple[str, ...] = ()  # per layer, as config.json names it
    where: str = field(default="config.json", compare=False)

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == kind]

    def state_numel(self, layer: int) -> int:
        return sum(math.prod(shape) for _, shape in self.states[layer])

    def kv_bytes_per_token(self) -> int:
        """K and V of one token in one attention layer, in the checkpoint's dtype."""
        return 2 * self.num_key_value_heads * self.head_dim * self.dtype_bytes

    def fields(self) -> Fields:
        return Fields(self.raw, self.where)


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a model directory needs config.json)")
    try:
        d = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        # ValueError: bad JSON, or an integer past Python's digit limit; RecursionError: nesting
        raise CheckpointError(f"{path}: not valid JSON ({_first_line(exc)})") from None
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: must hold a JSON object")
    return d


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def model_spec(d: dict[str, Any], where: str = "config.json") -> ModelSpec:
    """The spec of a supported family's config (CheckpointError naming the field otherwise)."""
    mt = d.get("model_type")
    if not isinstance(mt, str) or mt not in FAMILIES:
        raise CheckpointError(
            f"{where}: model_type {show(mt)} is not supported; supported: {sorted(FAMILIES)} "
            "(or kvreuse's own 'kvreuse-tiny')"
        )
    f = Fields(d, where)
    family = FAMILIES[mt]
    n = f.integer("num_hidden_layers", hi=MAX_LAYERS)
    types = _layer_types(f, family, n)
    hidden = f.integer("hidden_size")
    heads = f.integer("num_attention_heads")
    # Granite derives its KV heads, Granite and LFM2 their head size; elsewhere transformers'
    # defaults are its flagship model's sizes, which no other checkpoint can lean on
    derived = family in ("granite", "lfm2")
    kv = f.integer("num_key_value_heads", heads if family == "granite" else REQUIRED)
    if heads % kv:
        f.fail("num_key_value_heads", f"{kv} must divide num_attention_heads {heads}")
    if derived and not f.has("head_dim") and hidden < heads:
        f.fail("hidden_size", f"{hidden} is below num_attention_heads {heads} (no head_dim)")
    head_dim = f.integer("head_dim", hidden // heads if derived else REQUIRED)
    kinds = tuple(LAYER_TYPES[family][t][1] for t in types)
    window = None
    if "sliding" in kinds:
        window = f.integer("sliding_window", lo=2)
    dtype = d.get("dtype") or d.get("torch_dtype")
    spec = ModelSpec(
        model_type=mt,
        family=family,
        layer_kinds=kinds,
        mixers=tuple(LAYER_TYPES[family][t][0] for t in types),
        vocab_size=f.integer("vocab_size"),
        hidden_size=hidden,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=f.integer("max_position_embeddings"),
        sliding_window=window,
        dtype_bytes=DTYPE_BYTES.get(dtype, 4) if isinstance(dtype, str) else 4,
        raw=d,
        num_attention_heads=heads,
        layer_types=tuple(types),
        where=where,
    )
    parts: dict[str, tuple[tuple[str, tuple[int, ...]], ...]] = {}
    for i, mixer in enumerate(spec.mixers):
        if mixer != "attention":
            if mixer not in parts:  # every layer of a mixer has the same state: built once
                parts[mixer] = _state_parts(mixer, f, hidden)
            spec.states[i] = parts[mixer]
    return spec


def _layer_types(f: Fields, family: str, n: int) -> list[str]:
    """Each layer's type, as config.json lists it (`layer_types`, or Granite's older
    `layers_block_type`) or, in configs written before `layer_types` existed, as `transformers`
    derives it: Gemma 3 from `sliding_window_pattern`, Qwen3-Next from
    `full_attention_interval`, LFM2 from `full_attn_idxs`, Granite all Mamba-2."""
    table = LAYER_TYPES[family]
    keys = [k for k in ("layer_types", "layers_block_type") if f.has(k)]
    if keys:
        types = f.d[keys[0]]
        if not isinstance(types, list) or len(types) != n:
            f.fail(keys[0], f"must list {n} layer types (num_hidden_layers), got {show(types)}")
        bad = [t for t in types if not isinstance(t, str) or t not in table]
        if bad:
            raise CheckpointError(
                f"{f.where}: unknown {keys[0]} {show(bad[0])}; {f.d['model_type']} allows "
                f"{sorted(table)}"
            )
        if len(keys) == 2 and f.d["layers_block_type"] != types:
            f.fail("layers_block_type", "disagrees with layer_types; keep one")
        return types
    if family == "gemma3":
        key = "sliding_window_pattern"  # transformers 5 writes it with a leading underscore
        every = f.integer(key if f.has(key) else f"_{key}", 6)
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    if family == "qwen3_next":
        every = f.integer("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(n)]
    if family == "lfm2":
        full = f.integers("full_attn_idxs", n)
        full_set = set(range(n) if full is None else full)
        return ["full_attention" if i in full_set else "conv" for i in range(n)]
    return ["mamba"] * n


def _state_parts(mixer: str, f: Fields, hidden: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The parts of one recurrent layer's state: a conv window of the last k−1 conv inputs
    (always), then the SSM or delta-rule matrix where the mixer has one."""
    if mixer == "mamba2":
        heads, groups = f.integer("mamba_n_heads"), f.integer("mamba_n_groups")
        d_state, k = f.integer("mamba_d_state"), f.integer("mamba_d_conv", lo=2)
        inner = f.integer("mamba_expand") * hidden
        if inner % heads or heads % groups:
            f.fail(
                "mamba_n_heads",
                f"{heads} must divide mamba_expand × hidden_size ({inner}) "
                f"and be a multiple of mamba_n_groups ({groups})",
            )
        d_head = inner // heads
        if f.d.get("mamba_d_head") not in (None, "auto", d_head):
            f.fail(
                "mamba_d_head",
                f"is {show(f.d['mamba_d_head'])} but mamba_expand × hidden_size / mamba_n_heads "
                f"is {d_head}",
            )
        conv_dim = inner + 2 * groups * d_state
        return (("conv", (k - 1, conv_dim)), ("ssm", (heads, d_state, d_head)))
    if mixer == "short_conv":
        return (("conv", (f.integer("conv_L_cache", lo=2) - 1, hidden)),)
    # gated DeltaNet
    hk, hv = f.integer("linear_num_key_heads"), f.integer("linear_num_value_heads")
    if hv % hk:
        f.fail("linear_num_value_heads", f"{hv} must be a multiple of linear_num_key_heads {hk}")
    dk, dv = f.integer("linear_key_head_dim"), f.integer("linear_value_head_dim")
    k = f.integer("linear_conv_kernel_dim", lo=2)
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
        raise CheckpointError(
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
