"""The tiny model's configuration: an HF-style `config.json`, validated on load.

Layer kinds map onto the cache geometry's groups (see `paged.py`):

    "full"       full causal attention (RoPE, GQA)     -> the geometry's `full` target group
    "sliding"    sliding-window attention, window W    -> the `sliding` group (same W)
    "recurrent"  gated linear recurrence, state S      -> the `recurrent` group
    draft head   one EAGLE-style attention layer       -> the `full` group of role `draft`
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvreuse.hfconfig import read_config

MODEL_TYPE = "kvreuse-tiny"
LAYER_KINDS = ("full", "sliding", "recurrent")


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of the tiny decoder. Defaults give a ~0.2M-parameter fp32 model."""

    vocab_size: int = 320
    hidden_size: int = 64
    intermediate_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    layer_types: tuple[str, ...] = ("full", "full")
    sliding_window: int | None = None
    recurrent_heads: int = 4
    recurrent_key_dim: int = 16
    recurrent_value_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 8192
    draft_head: bool = False  # an EAGLE-style draft head (weights `draft.*`)
    tie_word_embeddings: bool = True
    model_type: str = MODEL_TYPE

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"config.json: {f.name} must be an int ≥ 1, got {v!r}")
        if self.model_type != MODEL_TYPE:
            raise ValueError(f"config.json: model_type {self.model_type!r} is not {MODEL_TYPE!r}")
        if not self.layer_types:
            raise ValueError("config.json: layer_types is empty; give at least one layer")
        bad = [t for t in self.layer_types if t not in LAYER_KINDS]
        if bad:
            raise ValueError(
                f"config.json: unknown layer_types {bad}; allowed: {list(LAYER_KINDS)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads {self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"config.json: head_dim {self.head_dim} must be even (RoPE)")
        if "sliding" in self.layer_types and (self.sliding_window or 0) < 2:
            raise ValueError("config.json: sliding layers need sliding_window ≥ 2")
        if not self.tie_word_embeddings:
            raise ValueError("config.json: only tie_word_embeddings = true is supported")

    def kv_shape(self, layer: str) -> tuple[int, int]:
        """(KV heads, head dim) of an attention layer's cache."""
        return self.num_key_value_heads, self.head_dim

    def state_shape(self, layer: str) -> tuple[int, ...]:
        """The shape of one recurrent layer's state (one slot of its state tensor)."""
        return self.recurrent_heads, self.recurrent_key_dim, self.recurrent_value_dim

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "config.json") -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}")
        try:
            return cls(**d)
        except TypeError as exc:
            raise ValueError(f"{where}: {exc}") from None

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> ModelConfig:
        return cls.from_dict(read_config(directory), str(Path(directory) / "config.json"))
