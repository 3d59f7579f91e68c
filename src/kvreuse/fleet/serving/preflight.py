"""What `kvreuse fleet` and `kvreuse route` check before they serve.

Before the fleet starts a replica: everything a replica would find out only after its start
(seconds each, all of them at once), found here in one line. The model directory holds a
config.json and weights that load and match it, its layers serve every group of the replicas'
geometry, and its tokenizer fits its vocabulary, by the checks `kvreuse serve` makes when it
loads them (`kvreuse.engine.LLM`), without building a cache.

Once the replicas run: every kvreuse replica serves the geometry the front hashes for
(`check_replicas`), and `kvreuse route` without `--geometry` takes the first one's
(`route_deployment`).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from kvreuse.fleet.serving.serve_args import UsageError


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


def route_deployment(geometry: str | None, first_url: str) -> Any:
    from kvreuse.deployment import resolve

    if geometry is not None:
        return resolve(geometry)
    dep = replica_geometry(first_url)
    if dep is None:
        raise UsageError(
            f"cannot read the geometry of {first_url} (GET /kvreuse/geometry): pass --geometry"
        )
    return dep


def replica_geometry(url: str) -> Any:
    """The deployment a kvreuse replica serves at /kvreuse/geometry, or None (another server,
    or none there)."""
    import httpx

    from kvreuse.deployment import GeometryError, load_geometry

    try:
        resp = httpx.get(f"{url.rstrip('/')}/kvreuse/geometry", timeout=5.0)
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    try:
        return load_geometry(resp.text, f"{url}/kvreuse/geometry")
    except (GeometryError, ValueError):
        return None


def check_replicas(dispatcher: Any, config: Any, required: bool) -> list[dict[str, Any]]:
    """Every kvreuse replica must hash like the front (same geometry but for the pool size);
    returns the model cards of the first replica that lists them."""
    import httpx

    models: list[dict[str, Any]] = []
    for member in dispatcher.members:
        dep = replica_geometry(member.url)
        if dep is None:
            if required:
                raise UsageError(f"{member.name} at {member.url} did not serve its geometry")
            note = f"note: {member.url} does not serve /kvreuse/geometry (not checked)"
            print(f"kvreuse route: {note}", file=sys.stderr)
        elif replace(dep.cache, num_blocks=config.num_blocks) != config:
            raise UsageError(
                f"{member.name} at {member.url} runs another geometry than the front hashes "
                f"for ({dep.name}); every replica of a fleet must share one"
            )
        if not models:
            try:
                data = httpx.get(f"{member.url}/v1/models", timeout=5.0).json().get("data")
                models = data if isinstance(data, list) else []
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
    return models
