"""A shared store's bytes in a Redis (or Valkey) server, for `BytesTier`.

    LLM 0 ─┐                                     one SharedTier (the core's index and LRU)
    LLM 1 ─┼─ BytesTier(RedisBytes(url, ns)) ──► redis: "kvreuse:<ns>:<slot>" → framed bytes
    LLM 2 ─┘

`RedisBytes` is a mapping of `str` to `bytes` kept in the server under `kvreuse:`. `LLM` binds
each `BytesTier` to a namespace inside it: for a shared tier `store_namespace(identity, tier)`
(a digest of the model's identity, `model_identity`: its whole config, weights and dtype; the
cache layout's `SharedTier.namespace`; the tier's name), so replicas of the same model and
layout read each other's bytes and no other replica does; for a tier of its own, a namespace of
its own. A server can hold many at once. `BytesTier` frames each value with its identity and a
tag keyed by the model's identity, so a value another writer changed, moved or lost is a miss
at its load, never used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch

from kvreuse.core import SharedTier, TierSpec

SECRET_ENV = "KVREUSE_STORE_SECRET"


class StoreUnavailable(RuntimeError):
    """The store server cannot be reached (or the client is not installed)."""


def weights_digest(weights: Mapping[str, torch.Tensor]) -> str:
    """A digest of a model's weights (names, shapes, dtypes and values)."""
    h = hashlib.sha256()
    for name, tensor in sorted(weights.items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_identity(config: object, weights: Mapping[str, torch.Tensor], dtype: str) -> str:
    """What determines the bytes of a block for given tokens: the model's whole config as the
    engine reads it (a checkpoint's config.json, every field, canonical JSON; else the
    embedded model's config), its weights and the cache's dtype. Not its directory's name:
    two checkpoints that differ in one config field never share a namespace."""
    if isinstance(config, Path):
        try:
            text = json.dumps(json.loads(config.read_text()), sort_keys=True)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{config}: cannot read it for the store's namespace: {exc}") from None
    else:
        text = repr(config)
    h = hashlib.sha256(b"kvreuse-model\0")
    for part in (text, weights_digest(weights), dtype):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def store_namespace(identity: str, tier: SharedTier) -> str:
    """The namespace of a shared tier's bytes: the model's identity and the cache layout."""
    return f"m{identity[:16]}:{tier.namespace}:{tier.spec.name}"


def tag_key(identity: str) -> bytes:
    """The key of a shared tier's tags: the model's whole identity (the namespace shows only a
    prefix of a digest of it) and `KVREUSE_STORE_SECRET` where set, so a writer without the
    model (or the secret) cannot make a value the replicas accept."""
    return identity.encode() + os.environ.get(SECRET_ENV, "").encode()


_FENCED_SET = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('set', KEYS[2], ARGV[2])
return 1
"""


class RedisBytes(MutableMapping[str, bytes]):
    """Values under `kvreuse:` in the server at `url` (redis://host:port/db). A write of a
    shared store presents the fence of the turn held (`turns`, kvreuse.serve.store_turns): a
    server whose turn was taken writes nothing. While `breaker` is open after an error, the
    server is not asked: reads and writes fail at once (the tier counts them as misses)."""

    def __init__(
        self, url: str, *, timeout_s: float = 2.0, client: Any = None, breaker: Any = None
    ) -> None:
        """`client`: a redis client for `url` (the server's, which keeps the password out of
        sight); `breaker`: one with `closed()` and `trip()` (kvreuse.serve.store_turns), or
        None to ask the server every time."""
        try:
            import redis
        except ImportError as exc:  # pragma: no cover - an install without the client
            raise StoreUnavailable(
                "the shared store needs the redis client: pip install 'kvreuse[engine]'"
            ) from exc
        self.url = url
        self.prefix = "kvreuse:"
        self.client: Any = client or redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self.breaker = breaker
        self.turns: Any = None
        self._fenced = self.client.register_script(_FENCED_SET)
        try:
            self.client.ping()
        except redis.RedisError as exc:
            where = url.rsplit("@", 1)[-1] if "@" in url else url  # no credentials in messages
            raise StoreUnavailable(
                f"cannot reach the store at {where} ({exc}); start one, e.g. "
                "redis-server --port 6379, or give another url"
            ) from None

    def _ask(self) -> None:
        if self.breaker is not None and not self.breaker.closed():
            raise StoreUnavailable("the store failed a moment ago; not asked until it may answer")

    def __getitem__(self, key: str) -> bytes:
        self._ask()
        try:
            value = self.client.get(self.prefix + key)
        except Exception:
            if self.breaker is not None:
                self.breaker.trip()
            raise
        if value is None:
            raise KeyError(key)
        return bytes(value)

    def __setitem__(self, key: str, value: bytes) -> None:
        self._ask()
        try:
            if self.turns is None:
                self.client.set(self.prefix + key, value)
                return
            fence = self.turns.fence
            if fence is None or not self._fenced(
                keys=[self.turns.keys.turn, self.prefix + key], args=[fence, value]
            ):
                raise StoreUnavailable(f"{key}: not written, this server's turn was taken")
        except StoreUnavailable:
            raise
        except Exception:
            if self.breaker is not None:
                self.breaker.trip()
            raise

    def __delitem__(self, key: str) -> None:
        if not self.client.delete(self.prefix + key):
            raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        n = len(self.prefix)
        for raw in self.client.scan_iter(match=self.prefix + "*", count=1000):
            yield raw.decode()[n:]

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def clear(self) -> None:
        """Delete every value kvreuse keeps in the server (and no other)."""
        self.clear_under("")

    def clear_under(self, namespace: str) -> None:
        """Delete the values whose keys start with `namespace` (one tier's: BytesTier.prefix)."""
        match = self.prefix + namespace.replace("*", r"\*") + "*"
        keys = list(self.client.scan_iter(match=match, count=1000))
        for i in range(0, len(keys), 1000):
            self.client.delete(*keys[i : i + 1000])


def release_own_tiers(tiers: Sequence[tuple[TierSpec | SharedTier, object]]) -> None:
    """Delete the bytes of the tiers that are this server's own (not shared) from their store:
    at a clean shutdown, so that restarts do not leave their namespaces behind. A store that
    fails to answer is left as it is (its values are never read again)."""
    from kvreuse.engine.tiers import BytesTier

    for spec, held in tiers:
        if isinstance(held, BytesTier) and not isinstance(spec, SharedTier):
            clear = getattr(held.store, "clear_under", None)
            with contextlib.suppress(Exception):  # shutting down: nothing is worth a traceback
                if clear is not None:
                    clear(held.prefix)
                else:
                    for key in [k for k in held.store if k.startswith(held.prefix)]:
                        del held.store[key]


def bind_tiers(tiers: Sequence[tuple[TierSpec | SharedTier, object]], identity: str) -> None:
    """Bind each `BytesTier` of `tiers` to its namespace (the module docstring): a shared
    tier's is the model's and the layout's, one of a replica's own is that replica's alone."""
    from kvreuse.engine.tiers import BytesTier

    key = tag_key(identity)
    for spec, held in tiers:
        if isinstance(held, BytesTier):
            if isinstance(spec, SharedTier):
                held.bind(store_namespace(identity, spec), key)
            else:
                held.bind(f"m{identity[:16]}:own-{uuid.uuid4().hex[:12]}:{spec.name}", key)
