"""Hugging Face checkpoints in the reference engine: Granite-4.0-H (Mamba-2 hybrid), Gemma 3
(sliding / full attention), LFM2 (short convolutions) and Qwen3-Next (gated DeltaNet + gated
attention), each layer written here in plain torch and checked against `transformers`' forward
(tests/engine/test_hf_families.py). `kvreuse.hfconfig` says which layer maps to which group."""

from __future__ import annotations

from pathlib import Path

from kvreuse.engine.checkpoint import check_weights
from kvreuse.engine.hf.base import Family, HFModel, load_weights
from kvreuse.hfconfig import is_hf_config, model_spec, read_config


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
    """A directory whose config.json names a supported Hugging Face family."""
    path = Path(directory)
    return (path / "config.json").is_file() and is_hf_config(read_config(path))


def load_hf_model(directory: str | Path) -> HFModel:
    """Read config.json and the safetensors weights of a supported family (ValueError naming
    the file and the key or tensor otherwise)."""
    path = Path(directory)
    spec = model_spec(read_config(path), str(path / "config.json"))
    weights = load_weights(path)
    family = _family(spec.family)(spec, weights)
    if family.tied():
        weights.pop("lm_head.weight", None)  # some checkpoints store the tied copy too
    check_weights(family.shapes(), weights, str(path))
    return HFModel(spec, family, path.name)


__all__ = ["HFModel", "is_hf_model_dir", "load_hf_model"]
