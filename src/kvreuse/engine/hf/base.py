"""A Hugging Face checkpoint run by the engine: weights from safetensors, layers in plain torch.

`HFModel` has the tiny model's interface (`forward(ids, positions, ctx)`, `logits`,
`dense_logits`), so the runner, the paged cache and `LLM` drive it unchanged. Each family
(`granite.py`, `gemma3.py`, `lfm2.py`, `qwen3_next.py`) says which tensors its config implies and
computes one decoder layer; attention goes through the context (paged, DCP-sharded KV) and every
recurrent mixer through `ctx.scan`, whose flat state row holds everything the mixer carries from
one token to the next (conv window included), so a save, a restore and a copy-on-write move all
of it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from kvreuse.engine.model import Context, DenseContext
from kvreuse.hfconfig import CheckpointError, Fields, ModelSpec, show


class HFConfig:
    """What the paged cache, the layer map and `LLM` read of a model's configuration."""

    draft_head = False

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.layer_types = spec.layer_kinds
        self.sliding_window = spec.sliding_window
        self.vocab_size = spec.vocab_size
        self.max_position_embeddings = spec.max_position_embeddings
        self.model_type = spec.model_type

    def kv_shape(self, layer: str) -> tuple[int, int]:
        return self.spec.num_key_value_heads, self.spec.head_dim

    def state_shape(self, layer: str) -> tuple[int, ...]:
        return (self.spec.state_numel(int(layer.rsplit(".", 1)[1])),)


Want = tuple[str, tuple[int, ...], str]  # a tensor, its shape, the fields that size it

# The fields all four families share, and what becomes of each (the family modules list theirs):
#   read by ModelSpec (kvreuse.hfconfig): model_type, vocab_size, hidden_size,
#     num_hidden_layers, layer_types, num_attention_heads, num_key_value_heads, head_dim,
#     max_position_embeddings; dtype only for the geometry's byte counts (the engine computes in
#     float32)
#   read here: tie_word_embeddings; quantization_config is refused when set
#   ignored, as they do not change the forward: initializer_range (initialisation),
#     attention_dropout (training), use_cache, pad_token_id (the padding row is an ordinary
#     row at inference), bos_token_id, eos_token_id (tokens, not math), architectures,
#     transformers_version, and every key transformers itself does not read


class Family:
    """One family's layer math over a checkpoint's tensors (names as the checkpoint has them).

    Construction reads every config.json field that changes the family's forward (`read`),
    refusing in one line what the engine does not compute, so nothing is looked up, and nothing
    can fail for want of a field, once requests run. The weights come later (`w`), after
    `shapes` has been checked against the safetensors headers."""

    TIED_DEFAULT = False  # transformers' tie_word_embeddings when config.json leaves it out
    # the fields that decide which tensors exist, named when a checkpoint holds one too many
    STRUCTURE = "num_hidden_layers, layer_types, tie_word_embeddings"

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.w: dict[str, Tensor] = {}
        f = spec.fields()
        if f.has("quantization_config"):
            f.fail("quantization_config", "is set: the engine runs unquantized float weights only")
        self.tie = f.flag("tie_word_embeddings", self.TIED_DEFAULT)
        self.read(f)

    def read(self, f: Fields) -> None:
        raise NotImplementedError

    def shapes(self) -> Iterator[Want]:
        """Every tensor the config implies, with its shape and the fields that size it."""
        raise NotImplementedError

    def embed(self, ids: Tensor) -> Tensor:
        return self.w["model.embed_tokens.weight"][ids]

    def layer(self, i: int, x: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        raise NotImplementedError

    def final(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def logits(self, h: Tensor) -> Tensor:
        return h @ self.lm_head().T

    def _linear(self, name: str, x: Tensor) -> Tensor:
        """x · Wᵀ (+ b where the checkpoint has `name.bias`)."""
        y = x @ self.w[f"{name}.weight"].T
        bias = self.w.get(f"{name}.bias")
        return y if bias is None else y + bias

    def lm_head(self) -> Tensor:
        if self.tie:
            return self.w["model.embed_tokens.weight"]
        return self.w["lm_head.weight"]

    def head_shapes(self) -> Iterator[Want]:
        v, d = self.spec.vocab_size, self.spec.hidden_size
        yield "model.embed_tokens.weight", (v, d), "vocab_size, hidden_size"
        if not self.tie:
            yield "lm_head.weight", (v, d), "vocab_size, hidden_size, tie_word_embeddings"


def choice(f: Fields, key: str, default: Any, allowed: tuple[Any, ...], why: str = "") -> Any:
    """A field's value out of `allowed`; any other is refused, `why` saying what is computed."""
    v = f.d.get(key)
    v = default if v is None else v
    if not any(type(v) is type(a) and v == a for a in allowed):
        names = " or ".join(show(a) for a in allowed)
        f.fail(key, f"{show(v)} is not supported{why}; allowed: {names}")
    return v


def silu_only(f: Fields) -> None:
    """Granite's and Qwen3-Next's MLPs and convolutions use `hidden_act`: SiLU is computed."""
    choice(f, "hidden_act", "silu", ("silu",), " (the engine's MLPs and convolutions use SiLU)")


def rotary_dim(f: Fields, head_dim: int, fraction: float) -> int:
    """The features RoPE turns, int(head_dim × partial_rotary_factor) as transformers computes
    them: an even count of at least 2, or the config is refused."""
    dim = int(head_dim * fraction)
    if dim < 2 or dim % 2:
        key = "head_dim" if fraction == 1 else "partial_rotary_factor"
        f.fail(
            key,
            f"gives {dim} rotary features (head_dim {head_dim} × {fraction}); RoPE "
            "turns an even number ≥ 2",
        )
    return dim


def aliased(f: Fields, key: str, alias: str) -> str:
    """The field to read for `key`: transformers takes an older spelling `alias` over it; when
    both are given they must agree."""
    if f.has(alias) and f.has(key) and f.d[alias] != f.d[key]:
        f.fail(alias, f"is {show(f.d[alias])} but {key} is {show(f.d[key])}; keep one")
    return alias if f.has(alias) else key


def attention_shapes(
    a: str,
    d: int,
    heads: tuple[int, int, int],
    *,
    gated: bool = False,
    out: str = "o_proj",
    norm: str = "norm",
    bias: bool = False,
) -> Iterator[Want]:
    """The weights of a grouped-query attention block `a` with per-head q and k norms:
    `heads` is (query heads, key/value heads, head dim); `gated` doubles q_proj's rows (a
    per-head output gate rides on the queries); `out` and `norm` name the output projection and
    the norms' suffix as the family spells them; `bias` adds the projections' biases."""
    nh, nkv, hd = heads
    q = (2 if gated else 1) * nh * hd
    why = "hidden_size, num_attention_heads, num_key_value_heads, head_dim"
    yield f"{a}.q_proj.weight", (q, d), why
    yield f"{a}.k_proj.weight", (nkv * hd, d), why
    yield f"{a}.v_proj.weight", (nkv * hd, d), why
    yield f"{a}.{out}.weight", (d, nh * hd), why
    yield f"{a}.q_{norm}.weight", (hd,), "head_dim"
    yield f"{a}.k_{norm}.weight", (hd,), "head_dim"
    if bias:
        for name, size in (("q", q), ("k", nkv * hd), ("v", nkv * hd)):
            yield f"{a}.{name}_proj.bias", (size,), f"attention_bias, {why}"
        yield f"{a}.{out}.bias", (d,), "attention_bias, hidden_size"


class HFModel:
    def __init__(self, spec: ModelSpec, family: Family, name: str) -> None:
        self.spec = spec
        self.family = family
        self.config = HFConfig(spec)
        self.name = name

    @torch.no_grad()
    def forward(self, ids: Tensor, positions: Tensor, ctx: Context) -> Tensor:
        x = self.family.embed(ids)
        for i in range(len(self.spec.layer_kinds)):
            x = self.family.layer(i, x, positions, ctx)
        return self.family.final(x)

    @torch.no_grad()
    def logits(self, hidden: Tensor) -> Tensor:
        return self.family.logits(hidden)

    @torch.no_grad()
    def dense_logits(self, token_ids: list[int]) -> Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long)
        pos = torch.arange(len(token_ids))
        return self.logits(self.forward(ids, pos, DenseContext(pos)))

    def draft_forward(self, hidden: Tensor, next_ids: Tensor, pos: Tensor, ctx: Context) -> Tensor:
        raise ValueError(f"{self.name}: a {self.spec.model_type} checkpoint has no draft head")


# safetensors dtype -> bytes per element; the float ones are the weights the engine takes
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
MAX_HEADER = 100 << 20  # safetensors' own limit on a header's size
LAYER = re.compile(r"model\.layers\.(\d{1,9})\.")


def weight_files(directory: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json names."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if not index.is_file():
        raise CheckpointError(
            f"{directory}: no model.safetensors (or model.safetensors.index.json)"
        )
    try:
        names = json.loads(index.read_text())["weight_map"].values()
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CheckpointError(f"{index}: not a safetensors index ({exc!r:.80})") from None
    for n in names:
        if not isinstance(n, str) or Path(n).name != n or not (directory / n).is_file():
            raise CheckpointError(f"{index}: weight_map names {show(n)}, not a file here")
    return [directory / n for n in sorted(set(names))]


def read_header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """A safetensors file's tensors (dtype, shape), read from its header alone: the data is not
    touched, so a config can be checked against the weights before anything is allocated."""
    bad = f"{path}: corrupt or not a safetensors file"
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            raw = fh.read(n) if 0 < n <= min(size - 8, MAX_HEADER) else None
        meta = None if raw is None else json.loads(raw)
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{bad} ({exc!r:.80})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{bad} (no header object)")
    out = {}
    for name, entry in meta.items():
        if name != "__metadata__":
            out[name] = _tensor_entry(entry, size - 8 - n, f"{bad} (tensor {show(name)})")
    return out


def _tensor_entry(entry: Any, data: int, bad: str) -> tuple[str, tuple[int, ...]]:
    """(dtype, shape) of a header entry whose byte range fits the file and its shape."""
    try:
        dtype, shape, (lo, hi) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        ok = (
            all(type(v) is int and v >= 0 for v in (*shape, lo, hi))
            and lo <= hi <= data
            and (hi - lo) == math.prod(shape) * DTYPE_SIZES[dtype]
        )
    except (TypeError, KeyError, ValueError):
        ok = False
    if not ok:
        raise CheckpointError(bad)
    return dtype, shape


def read_headers(files: list[Path]) -> dict[str, tuple[str, tuple[int, ...]]]:
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        for name, entry in read_header(f).items():
            if name in out:
                raise CheckpointError(f"{f}: tensor {name} is in another shard too")
            out[name] = entry
    return out


def check_header(
    family: Family, header: dict[str, tuple[str, tuple[int, ...]]], where: str
) -> None:
    """The tensors the weight files declare are exactly those config.json implies, of those
    shapes and a float dtype: checked on the headers, before any tensor is read, so a config
    that declares a million layers or a hidden size of 10⁹ is refused without allocating."""
    spec, f = family.spec, family.spec.fields()
    held = {int(m.group(1)) for name in header if (m := LAYER.match(name))}
    n = len(spec.layer_kinds)
    if held != set(range(n)):
        f.fail("num_hidden_layers", f"is {n} but the weights hold layers {_span(held)}")
    found: set[str] = set()
    for name, shape, why in family.shapes():
        if name not in header:
            raise CheckpointError(
                f"{where}: missing tensor {name} (config.json's {why} imply it"
                f"{_layer_note(spec, name)})"
            )
        dtype, have = header[name]
        if have != shape:
            raise CheckpointError(
                f"{where}: tensor {name} has shape {have}, config.json's {why} imply {shape}"
                f"{_layer_note(spec, name)}"
            )
        if dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{where}: tensor {name} is {dtype}; the engine takes floats")
        found.add(name)
    extra = sorted(set(header) - found - ({"lm_head.weight"} if family.tie else set()))
    if extra:
        raise CheckpointError(
            f"{where}: unexpected tensor(s) {extra[:3]}: config.json's {family.STRUCTURE} "
            "imply no such tensor"
        )


def _layer_note(spec: ModelSpec, name: str) -> str:
    """Which kind of layer config.json makes the layer a tensor belongs to (its layer_types)."""
    m = LAYER.match(name)
    return (
        ""
        if m is None
        else f"; layer {m.group(1)} is {spec.layer_types[int(m.group(1))]!r} (layer_types)"
    )


def _span(layers: set[int]) -> str:
    if not layers:
        return "none"
    ordered = sorted(layers)
    if ordered == list(range(ordered[0], ordered[-1] + 1)):
        return f"{ordered[0]}–{ordered[-1]}"
    return ", ".join(map(str, ordered[:6])) + (", …" if len(ordered) > 6 else "")


def load_weights(files: list[Path]) -> dict[str, Tensor]:
    """The tensors of the (header-checked) files, as float32."""
    weights: dict[str, Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{f}: corrupt or not a safetensors file ({exc!r:.80})") from None
    return {k: v.to(torch.float32) for k, v in weights.items()}
