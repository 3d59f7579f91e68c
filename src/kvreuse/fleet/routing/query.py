"""What a routing policy reads: a request hashed once (`Query`), the fleet it routes over
(`FleetView`, which `Router` implements) and what a load from a tier below a replica's pool
costs (`TierPrice`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kvreuse.core import Geometry
from kvreuse.core.spi import Chain
from kvreuse.events import ReplicaMirror
from kvreuse.events.holders import Holders
from kvreuse.events.wire import low64


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
            self._keys = low64(self.chain.hashes[1:])
        return self._keys


@dataclass(frozen=True, slots=True)
class TierPrice:
    """What loading from one tier costs, in prefill tokens (the routing cost's unit): each
    token a load carries is worth `per_token` prefill tokens (prefill rate / the tier's rate),
    and a request that loads from the tier at all pays `per_load` once (its latency × the
    prefill rate). The simulator's cost model prices a step's loads the same way."""

    per_token: float
    per_load: float = 0.0

    def __post_init__(self) -> None:
        for name in ("per_token", "per_load"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not (isinstance(v, int | float) and math.isfinite(v))
                or v < 0
            ):
                raise ValueError(f"tier price: {name} must be a finite number ≥ 0, got {v!r}")

    @classmethod
    def of_rates(
        cls, prefill_tokens_per_s: float, tier_tokens_per_s: float, tier_step_s: float
    ) -> TierPrice:
        """The price of a tier that moves `tier_tokens_per_s` with `tier_step_s` latency, on a
        replica that prefills `prefill_tokens_per_s`."""
        return cls(prefill_tokens_per_s / tier_tokens_per_s, tier_step_s * prefill_tokens_per_s)


# The simulator's default cost model (kvreuse.sim.cost.CostModel): host memory moves 10× the
# prefill rate with 0.5 ms a step, a store 2.5× with 2 ms. A medium without a price is priced
# as the store: a router that does not know a tier should not take its loads for cheap.
DEFAULT_TIER_PRICES: Mapping[str, TierPrice] = {"CPU": TierPrice(0.1, 10.0)}
UNKNOWN_TIER_PRICE = TierPrice(0.4, 40.0)


class FleetView(Protocol):
    """The router's state a policy reads: per replica, its name, mirror and load."""

    geometry: Geometry
    names: list[str]
    mirrors: list[ReplicaMirror]
    holders: Holders  # which replicas' devices hold each key of a full-attention group
    load_tokens: list[int]  # per replica, the tokens of `Router.set_load`'s rule
    num_requests: list[int]  # per replica, its unfinished routed requests
    load_weight: float
    tier_prices: Mapping[str, TierPrice]  # by medium; others cost UNKNOWN_TIER_PRICE
