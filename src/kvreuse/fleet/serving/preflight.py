"""What `kvreuse fleet` checks before it starts a replica: everything a replica would find out
only after its start (seconds each, all of them at once), found here in one line. The model
directory holds a config.json and weights that load and match it, its layers serve every group
of the replicas' geometry, and its tokenizer fits its vocabulary, by the checks `kvreuse serve`
makes when it loads them (`kvreuse.engine.LLM`), without building a cache.
"""

from __future__ import annotations

from typing import Any


def check_model(model: str | None, fake: bool, dep: Any, tokenizer: Any) -> None:
    """A ValueError naming the first thing the replicas would refuse (nothing for the embedded
    model or the fake one, which need no files)."""
    if model is None or fake:
        return
    try:
        from kvreuse.engine.checkpoint import load_model
        from kvreuse.engine.llm import check_model_fits
    except ImportError as exc:
        raise ValueError(
            f"--model needs the PyTorch engine ({exc}): pip install -e '.[engine,server]'"
        ) from None
    loaded = load_model(model)  # config.json and model.safetensors, each tensor checked
    check_model_fits(loaded.config, dep.cache)
    if tokenizer.vocab_size > loaded.config.vocab_size:
        raise ValueError(
            f"{model}: the tokenizer's vocab_size {tokenizer.vocab_size} exceeds the model's "
            f"{loaded.config.vocab_size}"
        )
