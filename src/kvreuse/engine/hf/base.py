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
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor

from kvreuse.engine.model import Context, DenseContext
from kvreuse.hfconfig import ModelSpec


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


class Family:
    """One family's layer math over a checkpoint's tensors (names as the checkpoint has them)."""

    def __init__(self, spec: ModelSpec, w: dict[str, Tensor]) -> None:
        self.spec = spec
        self.c = spec.raw
        self.w = w

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the config implies, with its shape."""
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
        if self.tied():
            return self.w["model.embed_tokens.weight"]
        return self.w["lm_head.weight"]

    def tied(self) -> bool:
        return bool(self.c.get("tie_word_embeddings", False))

    def head_shapes(self) -> dict[str, tuple[int, ...]]:
        v, d = self.spec.vocab_size, self.spec.hidden_size
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
        if not self.tied():
            out["lm_head.weight"] = (v, d)
        return out


def attention_shapes(
    a: str,
    d: int,
    heads: tuple[int, int, int],
    *,
    gated: bool = False,
    out: str = "o_proj",
    norm: str = "norm",
    bias: bool = False,
) -> dict[str, tuple[int, ...]]:
    """The weights of a grouped-query attention block `a` with per-head q and k norms:
    `heads` is (query heads, key/value heads, head dim); `gated` doubles q_proj's rows (a
    per-head output gate rides on the queries); `out` and `norm` name the output projection and
    the norms' suffix as the family spells them; `bias` adds the projections' biases."""
    nh, nkv, hd = heads
    q = (2 if gated else 1) * nh * hd
    shapes: dict[str, tuple[int, ...]] = {
        f"{a}.q_proj.weight": (q, d),
        f"{a}.k_proj.weight": (nkv * hd, d),
        f"{a}.v_proj.weight": (nkv * hd, d),
        f"{a}.{out}.weight": (d, nh * hd),
        f"{a}.q_{norm}.weight": (hd,),
        f"{a}.k_{norm}.weight": (hd,),
    }
    if bias:
        for name, size in (("q", q), ("k", nkv * hd), ("v", nkv * hd)):
            shapes[f"{a}.{name}_proj.bias"] = (size,)
        shapes[f"{a}.{out}.bias"] = (d,)
    return shapes


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


def load_weights(directory: Path) -> dict[str, Tensor]:
    """model.safetensors, or the shards model.safetensors.index.json names, as float32."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    files: list[Path]
    if single.is_file():
        files = [single]
    elif index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index}: not a safetensors index ({exc})") from None
        files = [directory / n for n in names]
    else:
        raise ValueError(f"{directory}: no model.safetensors (or model.safetensors.index.json)")
    weights: dict[str, Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ValueError(f"{f}: missing, corrupt or not a safetensors file ({exc})") from None
    return {k: v.to(torch.float32) for k, v in weights.items()}
