"""Save and load a model directory: `config.json` + `model.safetensors` (HF layout).

Loading checks the file against the config: every expected tensor present, none extra, exact
shapes, float dtype, finite values; each failure is a ValueError naming the file and the tensor.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvreuse.engine.config import ModelConfig
from kvreuse.engine.model import TinyModel, expected_shapes

WEIGHTS = "model.safetensors"


def save_model(model: object, directory: str | Path) -> Path:
    """Write `model` (a `TinyModel`, or an `LLM`, whose model is saved) to `directory`:
    config.json and model.safetensors, which `load_model` and `LLM(model=directory)` read."""
    inner = getattr(model, "model", None)
    if not isinstance(model, TinyModel) and isinstance(inner, TinyModel):
        model = inner  # an LLM: save the model it runs
    if not isinstance(model, TinyModel):
        raise ValueError(
            f"save_model takes a TinyModel or an LLM (whose .model is saved), "
            f"got {type(model).__name__}"
        )
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    model.config.save(path)
    tensors = {k: v.contiguous() for k, v in model.w.items()}
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    return path


def load_model(directory: str | Path) -> TinyModel:
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"{path}: not a model directory (config.json + {WEIGHTS})")
    cfg = ModelConfig.load(path)
    file = path / WEIGHTS
    if not file.is_file():
        raise ValueError(f"{file}: missing")
    try:
        weights = load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"{file}: corrupt or not a safetensors file ({exc})") from None
    check_weights(expected_shapes(cfg), weights, str(file))
    return TinyModel(cfg, {k: v.to(torch.float32) for k, v in weights.items()})


def check_weights(
    want: dict[str, tuple[int, ...]], weights: dict[str, torch.Tensor], where: str
) -> None:
    """The tensors of a checkpoint are exactly those its config.json implies (`want`: name to
    shape), each of that shape and of a float type; else one line naming the first offence."""
    missing = sorted(set(want) - set(weights))
    if missing:
        raise ValueError(f"{where}: missing tensor(s) {missing[:5]} (config.json implies them)")
    extra = sorted(set(weights) - set(want))
    if extra:
        raise ValueError(f"{where}: unexpected tensor(s) {extra[:5]} not implied by config.json")
    for name, shape in want.items():
        t = weights[name]
        if tuple(t.shape) != shape:
            raise ValueError(
                f"{where}: tensor {name} has shape {tuple(t.shape)}, config.json implies {shape}"
            )
        if not t.is_floating_point():
            raise ValueError(f"{where}: tensor {name} has dtype {t.dtype}; expected a float type")
    check_finite(weights, where)


def check_finite(weights: dict[str, torch.Tensor], where: str) -> None:
    """Every weight is a finite number: a NaN or an infinity would poison every logit it
    reaches, so it is refused at load rather than found in the first request's output."""
    for name, t in weights.items():
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{where}: tensor {name} holds NaN or infinite values")
