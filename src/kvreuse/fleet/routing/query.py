"""What a routing policy reads: a request hashed once (`Query`) and the fleet it routes over
(`FleetView`, which `Router` implements)."""

from __future__ import annotations

from typing import Protocol

from kvreuse.core import Chain, Geometry
from kvreuse.events import ReplicaMirror, hash64


class Query:
    """A request hashed once, for every replica and every policy.

    `chain` is the request's `[H[0], …, H[n]]` (what the core's lookup reads); `top` the most any
    replica can reuse (its last prompt token is always computed); `keys` the wire keys (low 64
    bits) of H[1] … H[n], computed on first use."""

    __slots__ = ("_keys", "chain", "num_tokens", "request_id", "top", "unit")

    def __init__(self, request_id: str, chain: Chain, num_tokens: int, unit: int) -> None:
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
