"""What a routing policy reads: a request hashed once (`Query`) and the fleet it routes over
(`FleetView`, which `Router` implements)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvreuse.core import Geometry, MultiModalItem
from kvreuse.events import ReplicaMirror, hash64


class ChainLike(Protocol):
    """A request's hash chain as the core builds it (`[H[0], …, H[n]]`, extended by tokens)."""

    hashes: list[bytes]
    num_units: int

    def adopt(self, hashes: Sequence[bytes]) -> None: ...

    def extend(self, tokens: Sequence[int]) -> int: ...


class ChainHasher(Protocol):
    """What builds a chain: a replica's hasher (`KVCacheManager.hasher`)."""

    hash_unit: int
    lookahead: int

    def chain(
        self,
        *,
        lora: tuple[str, str] | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        cache_salt: str | None = None,
    ) -> ChainLike: ...


class Query:
    """A request hashed once, for every replica and every policy.

    `chain` is the request's `[H[0], …, H[n]]` (what the core's lookup reads); `top` the most any
    replica can reuse (its last prompt token is always computed); `keys` the wire keys (low 64
    bits) of H[1] … H[n], computed on first use."""

    __slots__ = ("_keys", "chain", "num_tokens", "request_id", "top", "unit")

    def __init__(self, request_id: str, chain: ChainLike, num_tokens: int, unit: int) -> None:
        self.request_id = request_id
        self.chain = chain
        self.num_tokens = num_tokens
        self.unit = unit
        self.top = min(num_tokens - 1, chain.num_units * unit) // unit * unit
        self._keys: list[int] | None = None

    @property
    def keys(self) -> list[int]:
        if self._keys is None:
            self._keys = [hash64(h) for h in self.chain.hashes[1:]]
        return self._keys


class FleetView(Protocol):
    """The router's state a policy reads: per replica, its name, mirror and load."""

    geometry: Geometry
    names: list[str]
    mirrors: list[ReplicaMirror]
    load_tokens: list[int]  # per replica, the tokens of `Router.set_load`'s rule
    num_requests: list[int]  # per replica, its unfinished routed requests
    load_weight: float
