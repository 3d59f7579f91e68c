"""Cache configuration (spec §4): `GroupSpec`, `CacheConfig`, validation and the resolved geometry.

The user-facing dataclasses hold what the user wrote; `CacheConfig.geometry` resolves it once into
the numbers every other module uses (page sizes after DCP scaling, the hash unit, L, κ, S, K_max),
so no other module re-derives them.

    full attention, local block 2048, dcp 4:   one page = 2048 × 4 = 8192 tokens
    |<------------------------------ B = 8192 ----------------------------->|
    |256|256|256| ... hash units (u = gcd of LOCAL sizes = 256) ...     |256|
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from kvreuse.core.errors import ConfigError
from kvreuse.core.hashing.digests import HASH_ALGOS, algo_available
from kvreuse.core.hashing.hasher import Hasher
from kvreuse.core.kinds import KINDS, GroupGeometry, Stage
from kvreuse.core.kinds.base import check_int

GroupKind = str  # a name in kvreuse.core.kinds.KINDS ("full", "sliding", "chunked", "recurrent")
SPEC_MODES: tuple[str, ...] = ("none", "lookahead", "drop")
RETENTIONS: tuple[str, ...] = ("sparse", "dense")
ROLES: tuple[str, ...] = ("target", "draft")


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group of layers sharing a kind and a block geometry (spec §4)."""

    kind: GroupKind  # a registered kind (kvreuse.core.kinds)
    block_size: int
    dcp_sharded: bool | None = None
    window: int | None = None
    chunk: int | None = None
    role: Literal["target", "draft"] = "target"
    prefix_cacheable: bool = True
    state_scratch_blocks: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Geometry:
    """Numbers derived once from a `CacheConfig` (notation of spec §2)."""

    groups: tuple[GroupGeometry, ...]
    num_blocks: int
    hash_unit: int  # u
    lookahead: int  # L: lookahead_tokens in spec mode "lookahead", else 0
    kappa: int  # extra rolling checkpoint (9.4)
    common_page: int  # S: lcm of the cacheable page sizes
    max_keys_per_block: int  # K_max (11.3)
    ghost_capacity: int
    caching_enabled: bool
    spec_mode: str
    dense_retention: bool
    cacheable: tuple[GroupGeometry, ...]  # the prefix-cacheable groups, in id order
    only_full: bool  # every cacheable group is full attention with no drop margin: A1 = … = A4
    has_junction: bool  # recurrent and non-recurrent cacheable groups: a junction may exist
    recurrent: tuple[GroupGeometry, ...] = ()  # the recurrent groups (they plan saves)
    published: tuple[int, ...] = ()  # gids whose pages a commit publishes (caching on)
    windowed: bool = False  # a group whose commits free pages leaving its window
    paged: tuple[GroupGeometry, ...] = ()  # the groups of the paged layout (attention), in id order
    # hash_algo "sha256_cbor": the chain is vLLM's own, so events carry vLLM's extra keys,
    # the cache salt included (docs/decisions.md)
    vllm_hashes: bool = False


@dataclass(frozen=True)
class CacheConfig:
    """The whole cache geometry and policy knobs (spec §4). Validated on construction."""

    num_blocks: int
    groups: Sequence[GroupSpec]
    dcp_size: int = 1
    hash_unit: int | None = None
    hash_algo: Literal["sha256", "xxh3_128", "blake3", "sha256_cbor"] = "sha256"
    hash_seed: str | bytes | None = None
    spec_mode: Literal["none", "lookahead", "drop"] = "none"
    lookahead_tokens: int = 1
    recurrent_retention: Literal["sparse", "dense"] = "sparse"
    enable_prefix_caching: bool = True
    admission_watermark_blocks: int = 0
    ghost_capacity: int | None = None
    eviction_policy: str | Callable[[Any], Any] = "lru"
    enable_events: bool = True
    max_pending_events: int | None = 65536
    finished_stats_capacity: int | None = 10000
    _geometry: Geometry = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.groups, Sequence) or isinstance(self.groups, str | bytes):
            raise ConfigError(
                f"groups must be a list of GroupSpec, got {type(self.groups).__name__}"
            )
        object.__setattr__(self, "groups", tuple(self.groups))
        object.__setattr__(self, "_geometry", _resolve(self))

    @property
    def geometry(self) -> Geometry:
        return self._geometry

    # ------------------------------------------------------------------ sizing helpers (§4)
    @staticmethod
    def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
        """Blocks that fit in `budget_bytes` (the null block included)."""
        if block_bytes < 1 or budget_bytes < 0:
            raise ConfigError(
                f"budget_bytes must be ≥ 0 and block_bytes ≥ 1 (got {budget_bytes}, {block_bytes})"
            )
        num = budget_bytes // block_bytes
        if num < 2:
            raise ConfigError(
                f"a budget of {budget_bytes} bytes holds {num} blocks of {block_bytes} bytes; "
                "the pool needs at least 2 (the null block and one usable block)"
            )
        return num

    def hasher(self) -> Hasher:
        """The hasher of a cache of this configuration (algorithm, unit, lookahead, seed): what a
        manager hashes requests with, and what a router that mirrors one must hash with."""
        geo = self._geometry
        return Hasher(self.hash_algo, geo.hash_unit, geo.lookahead, self.hash_seed)

    def blocks_for_request(self, num_tokens: int, num_extra_slots: int = 0) -> int:
        """Upper bound of the blocks one request holds at any time (save blocks excluded)."""
        if num_tokens < 0 or num_extra_slots < 0:
            raise ValueError(
                f"num_tokens and num_extra_slots must be ≥ 0 (got {num_tokens}, {num_extra_slots})"
            )
        geo = self._geometry
        total = 0
        for g in geo.groups:
            total += g.blocks_held(num_tokens + num_extra_slots, geo.kappa)
        return total

    def capacity_tokens(
        self, num_blocks: int | None = None, concurrent_requests: int = 1
    ) -> int | None:
        """Largest t with `concurrent_requests × blocks_for_request(t) ≤ num_blocks − 1`, else 0.

        None when there is no largest t: without an attention group a request holds the same
        blocks at every length, so once its states fit, every length does."""
        blocks = self.num_blocks if num_blocks is None else num_blocks
        if concurrent_requests < 1:
            raise ValueError(f"concurrent_requests must be ≥ 1 (got {concurrent_requests})")
        budget = blocks - 1
        if concurrent_requests * self.blocks_for_request(0) > budget:
            return 0
        if not any(g.is_attention for g in self._geometry.groups):
            return None  # blocks_for_request(t) does not grow with t: doubling would not end
        lo, hi = 0, 1
        while concurrent_requests * self.blocks_for_request(hi) <= budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # invariant: lo fits, hi does not
            mid = (lo + hi) // 2
            if concurrent_requests * self.blocks_for_request(mid) <= budget:
                lo = mid
            else:
                hi = mid
        return lo


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# The kind parameters of GroupSpec, in the order they are checked, and the hint added when a
# group of another kind sets one (V3).
_KIND_PARAMS = {"window": "; remove it", "chunk": "; remove it", "state_scratch_blocks": ""}
_UNSET = {f.name: f.default for f in fields(GroupSpec)}


def _names(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _resolve_group(cfg: CacheConfig, gid: int, spec: GroupSpec) -> GroupGeometry:
    if not isinstance(spec, GroupSpec):
        raise ConfigError(f"group {gid} must be a GroupSpec, got {type(spec).__name__}")
    where = f"group {gid} ({spec.kind})"
    kind = KINDS.get(spec.kind) if isinstance(spec.kind, str) else None
    if kind is None:
        raise ConfigError(
            f"group {gid}: unknown kind {spec.kind!r}; allowed kinds: {', '.join(KINDS)}"
        )
    check_int(f"{where}: block_size", spec.block_size, 1)  # V1
    if spec.role not in ROLES:
        raise ConfigError(f"{where}: role must be 'target' or 'draft', got {spec.role!r}")
    sharded = kind.shardable if spec.dcp_sharded is None else bool(spec.dcp_sharded)
    if sharded and not kind.shardable:  # V2
        others = _names([k for k, c in KINDS.items() if not c.shardable])
        raise ConfigError(
            f"{where} is DCP-sharded: {others} groups must be replicated; set dcp_sharded=False"
        )
    page = spec.block_size * cfg.dcp_size if sharded else spec.block_size
    # V3: the kind's own parameters, and no parameter of another kind.
    for param, hint in _KIND_PARAMS.items():
        value = getattr(spec, param)
        if param in kind.params:
            kind.check_param(param, value, page, where)
        elif value != _UNSET[param]:
            owners = _names([k for k, c in KINDS.items() if param in c.params])
            raise ConfigError(f"{where}: {param} applies only to {owners} groups{hint}")
    kind.check_spec(spec.role, bool(spec.prefix_cacheable), where)  # V5, V6
    return kind(
        group_id=gid,
        block_size=spec.block_size,
        page_size=page,
        sharded=sharded,
        window=spec.window,
        chunk=spec.chunk,
        role=spec.role,
        cacheable=bool(spec.prefix_cacheable),
        scratch=spec.state_scratch_blocks,
    )


def _check_scalars(cfg: CacheConfig) -> None:
    check_int("num_blocks", cfg.num_blocks, 2)  # V1
    if not cfg.groups:
        raise ConfigError("groups is empty; a configuration needs at least one GroupSpec")
    check_int("dcp_size", cfg.dcp_size, 1)
    check_int("admission_watermark_blocks", cfg.admission_watermark_blocks, 0)
    for name in ("ghost_capacity", "max_pending_events", "finished_stats_capacity"):
        if getattr(cfg, name) is not None:
            check_int(name, getattr(cfg, name), 0)
    if cfg.eviction_policy != "lru" and not callable(cfg.eviction_policy):
        raise ConfigError(
            f"eviction_policy must be 'lru' or a callable factory(pool), "
            f"got {cfg.eviction_policy!r}"
        )
    if cfg.hash_algo not in HASH_ALGOS:
        raise ConfigError(f"hash_algo {cfg.hash_algo!r} is unknown; allowed: {HASH_ALGOS}")
    if not algo_available(cfg.hash_algo):  # V7
        pkg = "xxhash" if cfg.hash_algo == "xxh3_128" else "blake3"
        raise ConfigError(f"hash_algo {cfg.hash_algo!r} needs a package: pip install {pkg}")
    if cfg.spec_mode not in SPEC_MODES:
        raise ConfigError(f"spec_mode must be one of {SPEC_MODES}, got {cfg.spec_mode!r}")
    if cfg.recurrent_retention not in RETENTIONS:
        raise ConfigError(
            f"recurrent_retention must be one of {RETENTIONS}, got {cfg.recurrent_retention!r}"
        )
    if cfg.hash_seed is not None and not isinstance(cfg.hash_seed, str | bytes):
        raise ConfigError(f"hash_seed must be str, bytes or None, got {cfg.hash_seed!r}")


def _check_vllm_hashes(cfg: CacheConfig, groups: tuple[GroupGeometry, ...], u: int) -> None:
    """Where vLLM's own block hashes can be reproduced: vLLM hashes one block of one
    full-attention group at a time, with no lookahead and no DCP page; anything else names
    its blocks differently from any vLLM, so the mode would only pretend to match."""
    why = "hash_algo 'sha256_cbor' reproduces vLLM's block hashes only for"
    if cfg.hash_seed is not None and not isinstance(cfg.hash_seed, str):
        raise ConfigError(
            f"hash_algo 'sha256_cbor' needs hash_seed as a str (it plays vLLM's PYTHONHASHSEED), "
            f"got {type(cfg.hash_seed).__name__}"
        )
    if len(groups) != 1 or groups[0].stage is not Stage.FULL or groups[0].is_draft:
        raise ConfigError(
            f"{why} one full-attention target group, got {len(groups)} group(s)"
            f" ({', '.join(g.kind for g in groups)})"
        )
    g = groups[0]
    if g.page_size != g.block_size:
        raise ConfigError(f"{why} a page without DCP; {g.describe()} is sharded: use dcp_size=1")
    if u != g.block_size:
        raise ConfigError(f"{why} hash_unit = block_size ({g.block_size}), got hash_unit {u}")
    if cfg.spec_mode != "none":
        raise ConfigError(
            f"{why} spec_mode 'none' (vLLM hashes a block alone), got {cfg.spec_mode!r}"
        )


def _check_pages(cacheable: list[GroupGeometry], u: int) -> None:
    """V4: the hash unit divides every cacheable page."""
    page_gcd = math.gcd(*(g.page_size for g in cacheable)) if cacheable else u
    for g in cacheable:
        if g.page_size % u:
            raise ConfigError(
                f"hash_unit {u} does not divide the page of {g.describe()}. Every page must be a "
                f"multiple of hash_unit; valid values divide {page_gcd}: "
                f"{', '.join(map(str, _divisors(page_gcd)))}."
            )


def _resolve(cfg: CacheConfig) -> Geometry:
    _check_scalars(cfg)
    groups = tuple(_resolve_group(cfg, gid, spec) for gid, spec in enumerate(cfg.groups))
    cacheable = [g for g in groups if g.cacheable]
    base = cacheable or list(groups)
    if cfg.hash_unit is None:
        u = math.gcd(*(g.block_size for g in base))
    else:
        check_int("hash_unit", cfg.hash_unit, 1)  # V4
        u = cfg.hash_unit
    _check_pages(cacheable, u)
    lookahead = 0
    if cfg.spec_mode == "lookahead":  # V5
        check_int("lookahead_tokens", cfg.lookahead_tokens, 1)
        if cfg.lookahead_tokens > u:
            raise ConfigError(
                f"lookahead_tokens {cfg.lookahead_tokens} exceeds hash_unit {u}; use 1 … {u}"
            )
        lookahead = cfg.lookahead_tokens
    if cfg.spec_mode == "drop" and not any(g.is_draft for g in cacheable):
        raise ConfigError(
            "spec_mode 'drop' needs a prefix-cacheable group with role 'draft' (the drafter's KV); "
            "add one, or use spec_mode 'lookahead' or 'none'"
        )
    if cfg.hash_algo == "sha256_cbor":
        _check_vllm_hashes(cfg, groups, u)
    kappa = 1 if cfg.spec_mode == "drop" or lookahead >= 2 else 0
    common = math.lcm(*(g.page_size for g in cacheable)) if cacheable else u
    attn_keys = [g.page_size // u for g in cacheable if g.is_attention]
    k_max = max(attn_keys) if attn_keys else 1
    ghost = cfg.ghost_capacity
    if ghost is None:
        ghost = 2 * (cfg.num_blocks - 1) * k_max
    return Geometry(
        groups=groups,
        num_blocks=cfg.num_blocks,
        hash_unit=u,
        lookahead=lookahead,
        kappa=kappa,
        common_page=common,
        max_keys_per_block=k_max,
        ghost_capacity=ghost,
        caching_enabled=bool(cfg.enable_prefix_caching and cacheable),
        spec_mode=cfg.spec_mode,
        dense_retention=cfg.recurrent_retention == "dense",
        cacheable=tuple(cacheable),
        only_full=all(g.stage is Stage.FULL for g in cacheable)
        and not (cfg.spec_mode == "drop" and any(g.is_draft for g in cacheable)),
        has_junction=any(g.stage is Stage.STATE for g in cacheable)
        and any(g.stage is not Stage.STATE for g in cacheable),
        recurrent=tuple(g for g in groups if not g.is_attention),
        published=tuple(g.group_id for g in cacheable if g.is_attention)
        if cfg.enable_prefix_caching
        else (),
        windowed=any(g.frees_pages for g in groups),
        paged=tuple(g for g in groups if g.is_attention),
        vllm_hashes=cfg.hash_algo == "sha256_cbor",
    )
