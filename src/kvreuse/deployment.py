"""A deployment: the cache geometry, the scheduler's knobs and the context length, as one value.

`kvreuse simulate`, `kvreuse serve`, `kvreuse qualify` and `kvreuse.engine.LLM` all take one,
named by `resolve(spec)`: a preset name (`PRESETS`), a path to a TOML geometry file, or a
`Deployment` as is. A geometry file:

    [cache]
    num_blocks = 4096            # or capacity_tokens = 131072 (one request's worth, spec §4)
    dcp_size = 4
    hash_unit = 256
    max_num_seqs = 64            # scheduler knobs live here too
    max_num_batched_tokens = 8192
    max_model_len = 8192         # optional: the context length a server accepts

    [[groups]]
    kind = "full"
    block_size = 2048            # LOCAL tokens per block (per DCP rank)

    [[groups]]
    kind = "recurrent"
    block_size = 256

Unknown tables and keys are errors naming where they are; values are checked by `CacheConfig`
and `SchedulerConfig`, whose messages are passed through. `geometry_toml` writes a deployment
back as such a file (a server serves it to `kvreuse qualify`).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvreuse.core import CacheConfig, ConfigError, GroupSpec
from kvreuse.sched import SchedulerConfig

CACHE_KEYS = {f.name for f in fields(CacheConfig) if f.init} - {"groups", "eviction_policy"}
SCHED_KEYS = {f.name for f in fields(SchedulerConfig)} | {"max_model_len"}
GROUP_KEYS = {f.name for f in fields(GroupSpec)}


class GeometryError(ValueError):
    """A geometry file or deployment name is malformed; the message names the table and key."""


@dataclass(frozen=True)
class Deployment:
    """What one cache runs with: `name` (the preset or file it came from), the cache's
    configuration, the scheduler's, and the context length (None: what the model allows)."""

    name: str
    cache: CacheConfig
    sched: SchedulerConfig
    max_model_len: int | None


# What `resolve` accepts: a preset name, a path to a geometry file, or a deployment.
DeploymentSpec = str | os.PathLike[str] | Deployment

PRESETS: dict[str, str] = {
    "attention-16": """
        [cache]
        num_blocks = 8192
        [[groups]]
        kind = "full"
        block_size = 16
    """,
    "hybrid-dcp4": """
        [cache]
        num_blocks = 1024
        dcp_size = 4
        hash_unit = 256
        [[groups]]
        kind = "full"
        block_size = 2048
        [[groups]]
        kind = "recurrent"
        block_size = 256
    """,
    "sliding-hybrid": """
        [cache]
        num_blocks = 4096
        [[groups]]
        kind = "full"
        block_size = 16
        [[groups]]
        kind = "sliding"
        block_size = 16
        window = 1024
        [[groups]]
        kind = "recurrent"
        block_size = 64
    """,
    # Engine-sized geometries for the tiny PyTorch model (kvreuse.engine, tests, benchmarks).
    "tiny-attention": """
        [cache]
        num_blocks = 1024
        max_num_batched_tokens = 2048
        max_model_len = 8192
        [[groups]]
        kind = "full"
        block_size = 16
    """,
    "tiny-attention-dcp4": """
        [cache]
        num_blocks = 1024
        dcp_size = 4
        hash_unit = 8
        max_num_batched_tokens = 2048
        max_model_len = 8192
        [[groups]]
        kind = "full"
        block_size = 16
    """,
    "tiny-hybrid-dcp4": """
        [cache]
        num_blocks = 1024
        dcp_size = 4
        hash_unit = 8
        max_num_batched_tokens = 2048
        max_model_len = 8192
        [[groups]]
        kind = "full"
        block_size = 32
        [[groups]]
        kind = "recurrent"
        block_size = 8
    """,
    "tiny-sliding-hybrid": """
        [cache]
        num_blocks = 1024
        max_num_batched_tokens = 2048
        max_model_len = 8192
        [[groups]]
        kind = "full"
        block_size = 16
        [[groups]]
        kind = "sliding"
        block_size = 16
        window = 48
        [[groups]]
        kind = "recurrent"
        block_size = 16
    """,
}

# The two speculative presets differ only in the spec mode: full + recurrent target groups and
# the drafter's own full group.
_TINY_SPEC = """
        [cache]
        num_blocks = 1024
        {mode}
        max_num_batched_tokens = 2048
        max_model_len = 8192
        [[groups]]
        kind = "full"
        block_size = 16
        [[groups]]
        kind = "recurrent"
        block_size = 16
        [[groups]]
        kind = "full"
        block_size = 16
        role = "draft"
    """
PRESETS["tiny-spec-lookahead"] = _TINY_SPEC.format(
    mode='spec_mode = "lookahead"\n        lookahead_tokens = 1'
)
PRESETS["tiny-spec-drop"] = _TINY_SPEC.format(mode='spec_mode = "drop"')


def load_geometry(text: str, name: str = "geometry") -> Deployment:
    """Parse a TOML geometry (or raise GeometryError / ConfigError with a clear message)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise GeometryError(f"{name}: not valid TOML ({exc})") from None
    extra = set(doc) - {"cache", "groups"}
    if extra:
        raise GeometryError(f"{name}: unknown table(s) {sorted(extra)}; use [cache] and [[groups]]")
    cache = dict(doc.get("cache", {}))
    groups = doc.get("groups", [])
    if not isinstance(groups, list) or not groups:
        raise GeometryError(f"{name}: at least one [[groups]] table is needed")
    unknown = set(cache) - CACHE_KEYS - SCHED_KEYS - {"capacity_tokens"}
    if unknown:
        raise GeometryError(f"{name}: [cache] has unknown key(s) {sorted(unknown)}")
    specs = []
    for i, g in enumerate(groups):
        bad = set(g) - GROUP_KEYS
        if bad:
            raise GeometryError(
                f"{name}: [[groups]] #{i} has unknown key(s) {sorted(bad)}; "
                f"allowed: {sorted(GROUP_KEYS)}"
            )
        try:
            specs.append(GroupSpec(**g))
        except TypeError as exc:
            raise GeometryError(f"{name}: [[groups]] #{i}: {exc}") from None
    sched = {k: cache.pop(k) for k in list(cache) if k in SCHED_KEYS}
    max_model_len = sched.pop("max_model_len", None)
    cfg = _cache_config(name, cache, specs)
    try:
        sched_cfg = SchedulerConfig(**sched)
    except (TypeError, ValueError) as exc:
        raise GeometryError(f"{name}: [cache] scheduler setting: {exc}") from None
    return Deployment(name, cfg, sched_cfg, max_model_len)


def _cache_config(name: str, cache: dict[str, Any], specs: list[GroupSpec]) -> CacheConfig:
    capacity = cache.pop("capacity_tokens", None)
    if capacity is not None:
        if "num_blocks" in cache:
            raise GeometryError(
                f"{name}: [cache] sets both num_blocks and capacity_tokens; keep one"
            )
        if type(capacity) is not int or capacity < 1:
            raise GeometryError(f"{name}: [cache] capacity_tokens must be an int ≥ 1")
        probe = CacheConfig(num_blocks=2, groups=specs, **cache)
        cache["num_blocks"] = 1 + probe.blocks_for_request(capacity)
    if "num_blocks" not in cache:
        raise GeometryError(f"{name}: [cache] needs num_blocks or capacity_tokens")
    try:
        return CacheConfig(groups=specs, **cache)
    except ConfigError:
        raise
    except TypeError as exc:
        raise GeometryError(f"{name}: [cache]: {exc}") from None


def preset(name: str) -> Deployment:
    """The preset `name` of `PRESETS` (GeometryError listing the presets otherwise)."""
    if name not in PRESETS:
        raise GeometryError(f"unknown geometry preset {name!r}; presets: {sorted(PRESETS)}")
    return load_geometry(PRESETS[name], name)


def resolve(spec: DeploymentSpec) -> Deployment:
    """A deployment from a preset name, a path to a TOML geometry file (a `Path`, or a string
    ending in .toml or holding a "/"), or a `Deployment` (returned as is)."""
    if isinstance(spec, Deployment):
        return spec
    if isinstance(spec, os.PathLike) or (
        isinstance(spec, str) and (spec.endswith(".toml") or "/" in spec)
    ):
        try:
            text = Path(spec).read_text(encoding="utf-8")
        except OSError as exc:
            raise GeometryError(f"{spec}: cannot read the geometry file ({exc.strerror})") from None
        return load_geometry(text, str(spec))
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise GeometryError(
                f"unknown geometry {spec!r}: give a preset ({', '.join(sorted(PRESETS))}), "
                "a path to a .toml geometry file, or a Deployment"
            )
        return preset(spec)
    raise GeometryError(
        "a deployment is a preset name, a path to a .toml geometry file, or a Deployment; "
        f"got {type(spec).__name__}"
    )


def _toml_value(v: object) -> str | None:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return None  # None, bytes, callables: not representable, left at their defaults


def geometry_toml(dep: Deployment) -> str:
    """The deployment as a geometry file (`load_geometry` reads it back to an equal one)."""
    cfg, sched = dep.cache, dep.sched
    lines = ["[cache]"]
    for f in fields(cfg):
        if f.name in CACHE_KEYS and (v := _toml_value(getattr(cfg, f.name))) is not None:
            lines.append(f"{f.name} = {v}")
    for f in fields(sched):
        if (v := _toml_value(getattr(sched, f.name))) is not None:
            lines.append(f"{f.name} = {v}")
    if dep.max_model_len is not None:
        lines.append(f"max_model_len = {dep.max_model_len}")
    for g in cfg.groups:
        lines.append("[[groups]]")
        for f in fields(g):
            if (v := _toml_value(getattr(g, f.name))) is not None:
                lines.append(f"{f.name} = {v}")
    return "\n".join(lines) + "\n"
