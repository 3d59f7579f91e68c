"""What the server drives: a `Backend` (tokenizer + scheduler + manager + name + context length).

The default backend is `kvreuse.engine.LLM` (the embedded tiny PyTorch model). Tests that do not
need a real model use `fake_backend()`: a byte tokenizer and a `ScriptedEngine` whose next token
is a pure function of the tokens before it (`ContentTokens`), so a warm request answers exactly
like a cold one, as greedy decoding of a real model does; it rejects every draft and reports the
save at the end of a step only.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvreuse.core import KVCacheManager, SharedTier, TierSpec
from kvreuse.core.spi import DEVICE_MEDIUM
from kvreuse.deployment import (
    Deployment,
    DeploymentSpec,
    check_num_blocks,
    load_geometry,
    resolve,
)
from kvreuse.sched import ContentTokens, Scheduler, ScriptedEngine
from kvreuse.tiering import HOST_TIER, with_tiers
from kvreuse.tokenizer import ByteTokenizer, Tokenizer

FAKE_NAME = "fake-hybrid-dcp4"
FAKE_GEOMETRY = """
[cache]
num_blocks = 512
dcp_size = 4
hash_unit = 16
max_model_len = 2048
max_num_seqs = 64
max_num_batched_tokens = 2048
[[groups]]
kind = "full"
block_size = 16
[[groups]]
kind = "recurrent"
block_size = 16
"""


def _fake_sampling(**kwargs: Any) -> dict[str, Any]:
    return dict(kwargs)


@dataclass(frozen=True)
class TierOptions:
    """The tiers below the server's cache (`--host-capacity`, `--store-capacity`): each with
    room for the blocks one request of that many tokens needs, as `kvreuse simulate` sizes
    them. The store's bytes live in the Redis server at `store_url` (docs/tiers.md); the
    fake backend moves no bytes and needs none."""

    host_tokens: int | None = None
    store_tokens: int | None = None
    store_admission: str = "on-eviction"
    store_url: str | None = None
    store_shared: bool = False  # with the other servers of this model on `store_url`
    store_lease_s: float = 10.0  # a turn's lease on the shared store (kvreuse.serve.store_turns)

    def specs(self, dep: Deployment) -> tuple[TierSpec, ...]:
        bare = replace(dep, tiers=())
        return with_tiers(bare, self.host_tokens, self.store_tokens, self.store_admission).tiers

    def below(self, dep: Deployment) -> list[TierSpec | SharedTier]:
        """The tiers for a manager of `dep`: the store a `SharedTier` when it is shared."""
        return [
            SharedTier(s, dep.cache) if self.store_shared and s.name != HOST_TIER else s
            for s in self.specs(dep)
        ]


def share_store(
    sched: Scheduler, tiers: TierOptions, namespace: str | None = None, store: Any = None
) -> Any:
    """Give `sched` its turns over the store it shares with other servers
    (kvreuse.serve.store_turns): `namespace`, the store's bytes' (the engine's, whose
    `RedisBytes` is `store`: its writes then present the turn's fence), else one of the cache
    layout's alone (the fake backend, which keeps no bytes). Returns its `StoreTurns` (whose
    `log_key` a router reads to mirror the store), None when it shares none."""
    from kvreuse.serve.store_turns import StoreTurns
    from kvreuse.serve.store_view import redacted, redis_client

    shared = sched.mgr.tiers.shared
    if not shared or tiers.store_url is None:
        return None
    import redis

    tier = shared[0]
    assert isinstance(tier, SharedTier)
    client = redis_client(tiers.store_url, 2.0)
    try:
        client.ping()
    except redis.RedisError as exc:
        where = redacted(tiers.store_url)
        raise RuntimeError(f"cannot reach the store at {where} ({exc})") from None
    ns = namespace or f"fake:{tier.namespace}:{tier.spec.name}"
    breaker = getattr(store, "breaker", None)
    lease = tiers.store_lease_s
    turns = StoreTurns(tier, client, ns, lease_s=lease, wait_s=min(5.0, lease), breaker=breaker)
    check_store_meta(client, turns.keys.meta, tier)
    if store is not None:
        store.turns = turns
    sched.turn = turns.turn
    return turns


def check_store_meta(client: Any, key: str, tier: SharedTier) -> None:
    """Servers on one shared store agree on its capacity: the first one records it, a later
    one with another is refused in one line (its copy could not follow the others')."""
    import json

    mine = json.dumps({"capacity_blocks": tier.spec.num_blocks, "layout": tier.namespace})
    client.set(key, mine, nx=True)
    theirs = client.get(key)
    if theirs is not None and theirs.decode() != mine:
        got = json.loads(theirs)
        raise ValueError(
            f"the shared store holds a tier of {got.get('capacity_blocks')} blocks; this server's "
            f"--store-capacity gives {tier.spec.num_blocks}: servers sharing a store must give "
            "the same"
        )


@dataclass
class Backend:
    """Everything the server needs; only its step-loop thread touches `scheduler` and `mgr`."""

    name: str
    tokenizer: Tokenizer
    scheduler: Scheduler
    max_model_len: int
    deployment: Deployment | None = None  # what it was built from (None: an engine's own)
    make_sampling: Callable[..., Any] = _fake_sampling
    vocab_size: int | None = None  # token ids a prompt may hold (default: the tokenizer's)
    aliases: tuple[str, ...] = ()  # other names `model` may give (an earlier naming)
    notes: tuple[str, ...] = ()  # what `kvreuse serve` should tell the operator at start
    transfers: Any = None  # the engine's `Transfers` (bytes moved to and from its tiers)
    store_turns: Any = None  # a shared store's `StoreTurns` (kvreuse.serve.store_turns)
    on_close: Callable[[], None] | None = None  # at shutdown, after the step loop stopped

    def close(self) -> None:
        """The server is shutting down: drop what it alone kept outside itself (the bytes of
        its own store tier)."""
        if self.on_close is not None:
            self.on_close()

    @property
    def store_journal(self) -> str | None:
        """The Redis key of a shared store's log (None: it shares no store)."""
        return None if self.store_turns is None else str(self.store_turns.log_key)

    def store_view(self) -> str | None:
        """The shared store's view the last step ran on, as `STORE_VIEW_HEADER` names it:
        "<epoch>:<seq>", "detached"; None when the server shares no store. Read on the step
        loop's thread, right after the step."""
        if self.store_turns is None:
            return None
        return self.store_turns.followed or "detached"

    @property
    def token_limit(self) -> int:
        return self.vocab_size or self.tokenizer.vocab_size

    @property
    def mgr(self) -> KVCacheManager:
        return self.scheduler.mgr

    def cached_by_medium(self, rid: str, cached: int) -> dict[str, int] | None:
        """A request's cached tokens by where its first hit found them: the device ("GPU", as
        vLLM names it), then each tier below it by its medium; None without tiers."""
        tiers = self.mgr.tiers.tiers
        if not tiers:
            return None
        loaded = self.mgr.request_stats(rid).tier_tokens or (0,) * len(tiers)
        out = {DEVICE_MEDIUM: cached - sum(loaded)}
        out.update((t.spec.medium, n) for t, n in zip(tiers, loaded, strict=True))
        return out

    def live_deployment(self) -> Deployment:
        """The cache and scheduler settings it runs with (num_blocks overrides included)."""
        return Deployment(self.name, self.mgr.config, self.scheduler.config, self.max_model_len)


def fake_backend(
    geometry: DeploymentSpec | None = None,
    name: str = "kvreuse-fake",
    num_blocks: int | None = None,
    tiers: TierOptions | None = None,
) -> Backend:
    """The test backend on `geometry` (default: `FAKE_GEOMETRY`, a small DCP4 hybrid), with
    `tiers` below its cache (decided by the core; a fake model has no bytes to move)."""
    dep = load_geometry(FAKE_GEOMETRY, FAKE_NAME) if geometry is None else resolve(geometry)
    if num_blocks is not None:
        check_num_blocks(num_blocks, "fake_backend(num_blocks=...)")  # as LLM(num_blocks=) is
        dep = replace(dep, cache=replace(dep.cache, num_blocks=num_blocks))
    below = [] if tiers is None else tiers.below(dep)
    if tiers is not None:
        dep = replace(dep, tiers=tiers.specs(dep))
    engine = ScriptedEngine(ContentTokens(), saves="at_end")
    sched = Scheduler(KVCacheManager(dep.cache, tiers=below), engine, dep.sched)
    turns = share_store(sched, tiers) if tiers is not None and tiers.store_shared else None
    backend = Backend(name, ByteTokenizer(), sched, dep.max_model_len or 2048, dep)
    backend.store_turns = turns
    return backend


def served_name(engine_name: str, model: str | None) -> str:
    """The name clients use: a model directory's name, or for the embedded model
    "kvreuse-tiny-" + the geometry's name without a leading "tiny-" or a file's directory and
    extension ("kvreuse-tiny-hybrid-dcp4", "kvreuse-tiny-my-geometry")."""
    if model is not None:
        return Path(model).name or engine_name
    label = engine_name.removeprefix("kvreuse-tiny-")
    if label.endswith(".toml") or "/" in label or os.sep in label:
        label = Path(label).stem
    return "kvreuse-tiny-" + label.removeprefix("tiny-")


def default_backend(
    model: str | None = None,
    geometry: DeploymentSpec | None = None,
    num_blocks: int | None = None,
    tiers: TierOptions | None = None,
) -> Backend:
    """The embedded tiny model (`kvreuse.engine.LLM`); needs the `engine` extra (torch)."""
    try:
        from kvreuse.engine import LLM, SamplingParams
    except ImportError as exc:
        raise RuntimeError(
            f"kvreuse serve needs the PyTorch engine ({exc}); install it with "
            "pip install -e '.[engine,server]', or run with --fake for the test backend"
        ) from None
    kwargs: dict[str, Any] = {"num_blocks": num_blocks}
    if geometry is not None:
        kwargs["geometry"] = resolve(geometry)
    if tiers is not None:
        kwargs["tiers"] = _engine_tiers(model, kwargs.get("geometry"), tiers)
    llm = LLM(model, **kwargs)
    turns = None
    if tiers is not None and tiers.store_shared:
        held = [b for spec, b in kwargs["tiers"] if isinstance(spec, SharedTier)]
        turns = share_store(llm.scheduler, tiers, held[0].prefix.rstrip(":"), held[0].store)
    dep = kwargs.get("geometry")
    model_cfg = getattr(getattr(llm, "model", None), "config", None)
    vocab = getattr(model_cfg, "vocab_size", None)
    name = served_name(llm.model_name, model)
    wanted = (dep or llm.deployment).max_model_len
    notes: tuple[str, ...] = ()
    if wanted is not None and wanted > llm.max_model_len:
        notes = (
            f"warning: the model's context ({llm.max_model_len} positions) caps the geometry's "
            f"max_model_len {wanted}; serving at most {llm.max_model_len} tokens per request",
        )
    return Backend(
        name,
        llm.tokenizer,
        llm.scheduler,
        llm.max_model_len,
        dep,
        SamplingParams,
        vocab if isinstance(vocab, int) else None,
        aliases=tuple({llm.model_name} - {name}),
        notes=notes,
        transfers=llm.runner.transfers,
        store_turns=turns,
        on_close=None if tiers is None else functools.partial(release_own, kwargs["tiers"]),
    )


def release_own(tiers: list[tuple[TierSpec | SharedTier, Any]]) -> None:
    from kvreuse.engine.store import release_own_tiers

    release_own_tiers(tiers)


def _engine_tiers(
    model: str | None, dep: Deployment | None, tiers: TierOptions
) -> list[tuple[TierSpec | SharedTier, Any]]:
    """The LLM's tiers: the host's in this process's memory, the store's in Redis."""
    from kvreuse.engine.hf import is_hf_model_dir
    from kvreuse.engine.llm import DEFAULT_GEOMETRY
    from kvreuse.engine.store import RedisBytes
    from kvreuse.engine.tiers import BytesTier, HostTier
    from kvreuse.serve.store_turns import Breaker
    from kvreuse.serve.store_view import redis_client

    if dep is None:  # the deployment LLM will pick
        hf = model is not None and is_hf_model_dir(model)
        dep = resolve(model if hf and model is not None else DEFAULT_GEOMETRY)
    out: list[tuple[TierSpec | SharedTier, Any]] = []
    for spec in tiers.below(dep):
        name = spec.spec.name if isinstance(spec, SharedTier) else spec.name
        if name == HOST_TIER:
            out.append((spec, HostTier()))
        else:
            if tiers.store_url is None:
                raise ValueError("--store-capacity needs --store-url (a Redis server) or --fake")
            client = redis_client(tiers.store_url, 2.0)
            store = RedisBytes(tiers.store_url, client=client, breaker=Breaker())
            out.append((spec, BytesTier(store, name=name)))
    return out
