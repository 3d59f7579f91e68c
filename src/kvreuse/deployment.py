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

    [cost]                       # optional: this server's step costs (kvreuse.sim.cost)
    prefill_tokens_per_s = 13269

Unknown tables and keys are errors naming where they are; values are checked by `CacheConfig`
and `SchedulerConfig`, whose messages are passed through. `geometry_toml` writes a deployment
back as such a file (a server serves it to `kvreuse qualify`).
"""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvreuse.core import CacheConfig, ConfigError, GroupSpec, TierSpec
from kvreuse.hfconfig import model_geometry
from kvreuse.sched import SchedulerConfig
from kvreuse.vocab import too_many_blocks

CACHE_KEYS = {f.name for f in fields(CacheConfig) if f.init} - {"groups", "eviction_policy"}
SCHED_KEYS = {f.name for f in fields(SchedulerConfig)} | {"max_model_len"}
GROUP_KEYS = {f.name for f in fields(GroupSpec)}

TOML_INT_LIMIT = 2**63  # TOML integers are signed 64-bit; tomllib accepts any size


def _value_kind(annotation: object) -> type:
    """bool, int or str: what a TOML value of a dataclass field must be."""
    text = str(annotation)
    return bool if text.startswith("bool") else int if text.startswith("int") else str


# What each key's TOML value must be (the dataclasses' annotations, read once).
KEY_KINDS: dict[str, type] = {
    **{f.name: _value_kind(f.type) for f in fields(CacheConfig) if f.name in CACHE_KEYS},
    **{f.name: _value_kind(f.type) for f in fields(SchedulerConfig)},
    "max_model_len": int,
    "capacity_tokens": int,
}
GROUP_KEY_KINDS = {f.name: _value_kind(f.type) for f in fields(GroupSpec)}

# The [cost] table's keys and the closed range of each (kvreuse.sim.cost.CostModel's fields).
COST_LIMITS: dict[str, tuple[float, float]] = {
    "prefill_tokens_per_s": (1.0, 1e12),  # prefill throughput of a cold prompt
    "decode_step_s": (0.0, 3600.0),  # a step that decodes
    "saved_state_s": (0.0, 3600.0),  # each recurrent state a step writes
    "prefill_chunk_s": (0.0, 3600.0),  # each request a step prefills (per chunk)
    "host_tokens_per_s": (1.0, 1e15),  # tokens of KV a step loads from the host tier
    "host_step_s": (0.0, 3600.0),  # a step that loads from the host tier
    "store_tokens_per_s": (1.0, 1e15),  # the same from the shared store
    "store_step_s": (0.0, 3600.0),
}


def cost_problem(key: str, value: object) -> str | None:
    """Why `value` cannot be cost field `key` (a number in its range: NaN and ±inf are not),
    or None."""
    low, high = COST_LIMITS[key]
    if not isinstance(value, bool) and isinstance(value, int | float) and low <= value <= high:
        return None
    return f"{key} must be a number in [{low:g}, {high:g}], got {value!r}"


class GeometryError(ValueError):
    """A geometry file or deployment name is malformed; the message names the table and key."""


@dataclass(frozen=True)
class Deployment:
    """What one cache runs with: `name` (the preset or file it came from), the cache's
    configuration, the scheduler's, the context length (None: what the model allows), and the
    [cost] table as written (only the keys it sets; the simulator fills in the rest), and the
    memory tiers below the pool (`kvreuse simulate --host-capacity`; none by default)."""

    name: str
    cache: CacheConfig
    sched: SchedulerConfig
    max_model_len: int | None
    cost: dict[str, float] = field(default_factory=dict)
    tiers: tuple[TierSpec, ...] = ()


# What `resolve` accepts: a preset name, a path to a geometry file, or a deployment.
DeploymentSpec = str | os.PathLike[str] | Deployment

# Presets are geometry files; their [[groups]] are written as one inline array (TOML's other
# spelling of the same tables). `kvreuse geometry show NAME` prints one in the long form.
PRESETS: dict[str, str] = {
    "attention-16": """
        groups = [{kind = "full", block_size = 16}]
        [cache]
        num_blocks = 8192
    """,
    "sliding-hybrid": """
        groups = [
            {kind = "full", block_size = 16},
            {kind = "sliding", block_size = 16, window = 1024},
            {kind = "recurrent", block_size = 64},
        ]
        [cache]
        num_blocks = 4096
    """,
    # Engine-sized geometries for the tiny PyTorch model (kvreuse.engine, tests, benchmarks).
    # max_model_len leaves room for the default resend grid (8,193 + 8 tokens + 1 output).
    "tiny-attention": """
        groups = [{kind = "full", block_size = 16}]
        [cache]
        num_blocks = 1024
        max_num_batched_tokens = 2048
        max_model_len = 16384
    """,
    "tiny-attention-dcp4": """
        groups = [{kind = "full", block_size = 16}]
        [cache]
        num_blocks = 1024
        dcp_size = 4
        hash_unit = 8
        max_num_batched_tokens = 2048
        max_model_len = 16384
    """,
    "tiny-hybrid-dcp4": """
        groups = [{kind = "full", block_size = 32}, {kind = "recurrent", block_size = 8}]
        [cache]
        num_blocks = 1024
        dcp_size = 4
        hash_unit = 8
        max_num_batched_tokens = 2048
        max_model_len = 16384
    """,
    "tiny-sliding-hybrid": """
        groups = [
            {kind = "full", block_size = 16},
            {kind = "sliding", block_size = 16, window = 48},
            {kind = "recurrent", block_size = 16},
        ]
        [cache]
        num_blocks = 1024
        max_num_batched_tokens = 2048
        max_model_len = 16384
    """,
}

# The two speculative presets differ only in the spec mode: full + recurrent target groups and
# the drafter's own full group; each decode step verifies three drafts. Twice the blocks of the
# other tiny presets: every token is cached twice (target and drafter), and the default resend
# grid's longest prompt must fit.
_TINY_SPEC = """
        groups = [
            {{kind = "full", block_size = 16}},
            {{kind = "recurrent", block_size = 16}},
            {{kind = "full", block_size = 16, role = "draft"}},
        ]
        [cache]
        num_blocks = 2048
        {mode}
        num_spec_tokens = 3
        max_num_batched_tokens = 2048
        max_model_len = 16384
    """
PRESETS["tiny-spec-lookahead"] = _TINY_SPEC.format(
    mode='spec_mode = "lookahead"\n        lookahead_tokens = 1'
)
PRESETS["tiny-spec-drop"] = _TINY_SPEC.format(mode='spec_mode = "drop"')

# hybrid-dcp4, and its attention with a recurrent state kept at every recurrent page (dense
# retention, as an engine that checkpoints each page does) of 256 or 2,048 tokens on one server's
# [cost]: its cold 32 K prefill ran 12,759 tokens/s with 2,048-token pages and 10,200 with 256
# (kvreuse.sim.cost.fit_state_cost derives the [cost] from them; docs/simulate.md).
_HYBRID_DCP4 = """
        groups = [{{kind = "full", block_size = 2048}}, {{kind = "recurrent", block_size = {page}}}]
        [cache]
        num_blocks = 1024
        dcp_size = 4
        hash_unit = 256
        {more}
    """
PRESETS["hybrid-dcp4"] = _HYBRID_DCP4.format(page=256, more="")
for _page in (256, 2048):
    PRESETS[f"hybrid-dcp4-ckpt{_page}"] = _HYBRID_DCP4.format(
        page=_page,
        more='recurrent_retention = "dense"\n        [cost]\n        prefill_tokens_per_s = 13269'
        "\n        saved_state_s = 0.0058",
    )


def load_geometry(text: str, name: str = "geometry") -> Deployment:
    """Parse a TOML geometry (or raise GeometryError / ConfigError naming `name`)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise GeometryError(f"{name}: not valid TOML ({exc})") from None
    extra = set(doc) - {"cache", "groups", "cost"}
    if extra:
        raise GeometryError(
            f"{name}: unknown table(s) {sorted(extra)}; use [cache], [[groups]] and [cost]"
        )
    cache = doc.get("cache", {})
    if not isinstance(cache, dict):
        raise GeometryError(f"{name}: cache must be a table ([cache] with key = value lines)")
    cache = dict(cache)
    _check_keys(name, "[cache]", cache, {*CACHE_KEYS, *SCHED_KEYS, "capacity_tokens"})
    _check_values(name, "[cache]", cache, KEY_KINDS)
    specs = [_group_spec(name, i, g) for i, g in enumerate(_group_tables(name, doc))]
    sched = {k: cache.pop(k) for k in list(cache) if k in SCHED_KEYS}
    max_model_len = sched.pop("max_model_len", None)
    if max_model_len is not None and max_model_len < 1:
        raise GeometryError(f"{name}: [cache] max_model_len must be ≥ 1, got {max_model_len}")
    cfg = _cache_config(name, cache, specs)
    try:
        sched_cfg = SchedulerConfig(**sched)
    except (TypeError, ValueError) as exc:
        raise GeometryError(f"{name}: [cache] scheduler setting: {exc}") from None
    return Deployment(name, cfg, sched_cfg, max_model_len, _cost_table(name, doc.get("cost", {})))


def _cost_table(name: str, table: Any) -> dict[str, float]:
    if not isinstance(table, dict):
        raise GeometryError(f"{name}: cost must be a table ([cost] with key = value lines)")
    _check_keys(name, "[cost]", table, set(COST_LIMITS))
    for key, value in table.items():
        problem = cost_problem(key, value)
        if problem is not None:
            raise GeometryError(f"{name}: [cost] {problem}")
    return {key: float(table[key]) for key in COST_LIMITS if key in table}


def _group_tables(name: str, doc: dict[str, Any]) -> list[dict[str, Any]]:
    groups = doc.get("groups", [])
    if not isinstance(groups, list) or not groups:
        raise GeometryError(
            f"{name}: at least one [[groups]] table is needed (kind = ..., block_size = ...)"
        )
    for i, g in enumerate(groups):
        if not isinstance(g, dict):
            raise GeometryError(
                f"{name}: [[groups]] #{i} must be a table ([[groups]] with kind = ..., "
                f"block_size = ...), got {g!r}"
            )
    return groups


def _group_spec(name: str, i: int, table: dict[str, Any]) -> GroupSpec:
    where = f"[[groups]] #{i}"
    _check_keys(name, where, table, GROUP_KEYS)
    _check_values(name, where, table, GROUP_KEY_KINDS)
    missing = [k for k in ("kind", "block_size") if k not in table]
    if missing:
        raise GeometryError(f"{name}: {where} needs kind and block_size; missing {missing}")
    return GroupSpec(**table)


def _check_keys(name: str, where: str, table: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, allowed, n=1)
        if close:
            hints.append(f"{key!r}: did you mean {close[0]!r}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    raise GeometryError(
        f"{name}: {where} has unknown key(s) {unknown}{hint}; allowed: {sorted(allowed)}"
    )


def _check_values(name: str, where: str, table: dict[str, Any], kinds: dict[str, type]) -> None:
    """Every value has its key's TOML type: a string is never taken for a boolean, and an
    integer must lie in TOML's signed 64-bit range."""
    for key, value in table.items():
        kind = kinds[key]
        if kind is bool and not isinstance(value, bool):
            raise GeometryError(f"{name}: {where} {key} must be true or false, got {value!r}")
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise GeometryError(f"{name}: {where} {key} must be an integer, got {value!r}")
            if not -TOML_INT_LIMIT <= value < TOML_INT_LIMIT:
                raise GeometryError(
                    f"{name}: {where} {key} = {value} is outside TOML's 64-bit integer range"
                )
        if kind is str and not isinstance(value, str):
            raise GeometryError(f"{name}: {where} {key} must be a string, got {value!r}")


def check_num_blocks(num_blocks: int, where: str, because: str = "") -> None:
    """Refuse a pool whose bookkeeping alone would not fit a machine (GeometryError; the rule
    is `kvreuse.vocab.too_many_blocks`, which `--num-blocks` applies as it is read)."""
    problem = too_many_blocks(num_blocks, f"{where}: num_blocks = {num_blocks:,}{because}")
    if problem is not None:
        raise GeometryError(problem)


def blocks_for_capacity(cache: CacheConfig, capacity_tokens: int) -> int:
    """The pool that `capacity_tokens = N` asks for: the null block plus every block one
    request of N tokens holds (its pages and its recurrent states' slots)."""
    return 1 + cache.blocks_for_request(capacity_tokens)


def _cache_config(name: str, cache: dict[str, Any], specs: list[GroupSpec]) -> CacheConfig:
    capacity = cache.pop("capacity_tokens", None)
    try:
        if capacity is not None:
            if "num_blocks" in cache:
                raise GeometryError(
                    f"{name}: [cache] sets both num_blocks and capacity_tokens; keep one"
                )
            if capacity < 1:
                raise GeometryError(f"{name}: [cache] capacity_tokens must be ≥ 1")
            probe = CacheConfig(num_blocks=2, groups=specs, **cache)
            cache["num_blocks"] = blocks_for_capacity(probe, capacity)
        if "num_blocks" not in cache:
            raise GeometryError(f"{name}: [cache] needs num_blocks or capacity_tokens")
        because = "" if capacity is None else f" (for capacity_tokens = {capacity:,})"
        check_num_blocks(cache["num_blocks"], f"{name}: [cache]", because)
        return CacheConfig(groups=specs, **cache)
    except ConfigError as exc:  # the core's message, named after the file it came from
        raise ConfigError(f"{name}: {exc}") from None


def preset(name: str) -> Deployment:
    """The preset `name` of `PRESETS` (GeometryError listing the presets otherwise)."""
    if name not in PRESETS:
        raise GeometryError(f"unknown geometry preset {name!r}; presets: {sorted(PRESETS)}")
    return load_geometry(PRESETS[name], name)


def resolve(spec: DeploymentSpec) -> Deployment:
    """A deployment from a preset name, a path to a TOML geometry file (a `Path`, or a string
    ending in .toml or holding a "/"), a Hugging Face model directory (its default geometry,
    `kvreuse.hfconfig.model_geometry`), or a `Deployment` (returned as is)."""
    if isinstance(spec, Deployment):
        return spec
    if isinstance(spec, os.PathLike) or (
        isinstance(spec, str) and (spec.endswith(".toml") or "/" in spec)
    ):
        if Path(spec).is_dir():  # a Hugging Face checkpoint: the geometry its config implies
            return load_geometry(model_geometry(Path(spec)), str(spec))
        try:
            text = Path(spec).read_text(encoding="utf-8")
        except OSError as exc:
            raise GeometryError(f"{spec}: cannot read the geometry file ({exc.strerror})") from None
        return load_geometry(text, str(spec))
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise GeometryError(
                f"unknown geometry {spec!r}: give a preset ({', '.join(sorted(PRESETS))}) "
                "or a path to a .toml geometry file"
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
    if isinstance(v, float):
        return repr(v)  # finite (validated): Python's repr is a TOML float
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
    if dep.cost:
        lines.append("[cost]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in dep.cost.items())
    return "\n".join(lines) + "\n"
