"""Geometry files (TOML) and presets for `kvreuse simulate` (issue 3, slice).

    [cache]
    num_blocks = 4096            # or capacity_tokens = 131072 (one request's worth, spec §4)
    dcp_size = 4
    hash_unit = 256
    max_num_seqs = 64            # scheduler knobs live here too
    max_num_batched_tokens = 8192

    [[groups]]
    kind = "full"
    block_size = 2048            # LOCAL tokens per block (per DCP rank)

    [[groups]]
    kind = "recurrent"
    block_size = 256

Unknown tables and keys are errors naming where they are; values are checked by `CacheConfig`
and `SchedulerConfig`, whose messages are passed through.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from typing import Any

from kvreuse.core import CacheConfig, ConfigError, GroupSpec
from kvreuse.sched import SchedulerConfig

CACHE_KEYS = {f.name for f in fields(CacheConfig) if f.init} - {"groups", "eviction_policy"}
SCHED_KEYS = {f.name for f in fields(SchedulerConfig)} | {"max_model_len"}
GROUP_KEYS = {f.name for f in fields(GroupSpec)}


class GeometryError(ValueError):
    """A geometry file is malformed; the message names the table and key."""


@dataclass(frozen=True)
class SimGeometry:
    name: str
    cache: CacheConfig
    sched: SchedulerConfig
    max_model_len: int | None


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


def load_geometry(text: str, name: str = "geometry") -> SimGeometry:
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
    return SimGeometry(name, cfg, sched_cfg, max_model_len)


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


def preset(name: str) -> SimGeometry:
    if name not in PRESETS:
        raise GeometryError(f"unknown geometry preset {name!r}; presets: {sorted(PRESETS)}")
    return load_geometry(PRESETS[name], name)
