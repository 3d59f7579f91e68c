"""Hugging Face checkpoints in the reference engine: Granite-4.0-H (Mamba-2 hybrid), Gemma 3
(sliding / full attention), LFM2 (short convolutions) and Qwen3-Next (gated DeltaNet + gated
attention), each layer written here in plain torch and checked against `transformers`' forward
(tests/engine/test_hf_families.py). `kvreuse.hfconfig` says which layer maps to which group."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from kvreuse.engine.checkpoint import check_finite
from kvreuse.engine.config import MODEL_TYPE, ModelConfig
from kvreuse.engine.hf.base import (
    Family,
    HFModel,
    check_header,
    load_weights,
    read_headers,
    weight_files,
)
from kvreuse.hfconfig import CheckpointError, model_spec, read_config


def _family(name: str) -> type[Family]:
    if name == "granite":
        from kvreuse.engine.hf.granite import Granite

        return Granite
    if name == "gemma3":
        from kvreuse.engine.hf.gemma3 import Gemma3

        return Gemma3
    if name == "lfm2":
        from kvreuse.engine.hf.lfm2 import Lfm2

        return Lfm2
    from kvreuse.engine.hf.qwen3_next import Qwen3Next

    return Qwen3Next


def is_hf_model_dir(directory: str | Path) -> bool:
    """A directory whose config.json is not kvreuse's own tiny model's (model_type
    'kvreuse-tiny', or no model_type and only the tiny model's fields): a Hugging Face
    checkpoint, which loads as a supported family or is refused naming its model_type."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        return False
    d = read_config(path)
    if "model_type" in d:
        return bool(d["model_type"] != MODEL_TYPE)
    return not set(d) <= {f.name for f in fields(ModelConfig)}


def load_hf_model(directory: str | Path) -> HFModel:
    """Read config.json and the safetensors weights of a supported family, or refuse them with
    one line (CheckpointError, a ValueError) naming the file and the field or tensor.

    Everything is checked at load, in an order that allocates nothing a config merely claims:
    the config's fields (every one that changes the forward, `Family.read`), then the tensors it
    implies against the weight files' headers (names, shapes, dtypes; no data read), then the
    tensors themselves (finite values)."""
    path = Path(directory)
    spec = model_spec(read_config(path), str(path / "config.json"))
    family = _family(spec.family)(spec)
    files = weight_files(path)
    check_header(family, read_headers(files), str(path))
    weights = load_weights(files)
    if family.tie:
        weights.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
    check_finite(weights, str(path))
    family.w = weights
    return HFModel(spec, family, path.name)


__all__ = ["CheckpointError", "HFModel", "is_hf_model_dir", "load_hf_model"]
