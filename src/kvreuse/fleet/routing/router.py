"""A router over several replicas: a mirror of each replica's cache, each replica's load, and
one policy (`kvreuse.fleet.routing.policy`) that picks where a request goes.

The router hashes a request once (`Router.query`, with the hasher the replicas use) and every
policy reads that one chain for every replica. A replica's mirror is a
`kvreuse.events.ReplicaMirror`, kept current either in-process (`Router.apply` with the wire
events `Converter.convert` makes of a core's `take_events()`: what the fleet simulator does) or
by a `kvreuse.events.Subscriber` that owns it:

    router = Router(config, "exact")
    for name, endpoint in replicas:
        router.add_replica(name, subscriber.add_replica(name, config.geometry, endpoint))
    subscriber.poll(); router.set_load(i, tokens, requests)
    decision = router.route(router.query(tokens, request_id=rid))

A replica's load is the caller's to set (`set_load`), by one rule: the tokens of the requests
routed to it and not yet finished (their prompts, plus the output generated so far as far as the
caller sees it), and their number. The fleet simulation sees every step, so its load counts
output tokens as they are generated; the live front sees an answer only when it completes, so
its load is the prompts in flight. (docs/decisions.md D70.)

Cost (policies `attention-chain` and `exact`), lowest wins, ties to the lower load then index:

    cost_r = (prompt tokens − predicted cached tokens on r) + load_weight × load_tokens_r

`load_weight` says how many prefill tokens one token of load is worth. At 1 it is the cost
Dynamo's KV router minimises by default (prefill blocks plus active blocks, in tokens). On a
replica with tiers (its mirror knows their media), `exact` adds the price of the loads its hit
needs, `tier_prices` by medium (`TierPrice`; `DEFAULT_TIER_PRICES`), and `Decision.from_tiers`
says, per replica, how many of the predicted tokens each tier would give.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.core import CacheConfig, Geometry, MultiModalItem
from kvreuse.core.spi import TOKEN_TYPECODE, Chain, Hasher, Stage
from kvreuse.events import ReplicaMirror, StoreMirror, attention_group
from kvreuse.events.holders import Holders
from kvreuse.events.wire import WireEvent
from kvreuse.fleet import DEFAULT_LOAD_WEIGHT
from kvreuse.fleet.routing.policy import Policy, make_policy
from kvreuse.fleet.routing.query import DEFAULT_TIER_PRICES, Query, TierPrice


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes, and what the policy expected there.

    `predicted[r]`: the cached tokens the policy predicts on replica r (capped at the request's
    `top`), or None for a policy that looks at no cache (round-robin, least-loaded). `costs[r]`:
    the cost it minimised, when it minimised one. `from_tiers[r]`: per tier of replica r, the
    predicted tokens it would load from there (None when no replica has tiers)."""

    index: int
    replica: str
    policy: str
    num_tokens: int
    top: int
    predicted: tuple[int, ...] | None
    costs: tuple[float, ...] | None = None
    from_tiers: tuple[tuple[int, ...], ...] | None = None

    @property
    def predicted_cached(self) -> int | None:
        """The prediction for the chosen replica."""
        return None if self.predicted is None else self.predicted[self.index]

    @property
    def predicted_tiers(self) -> tuple[int, ...] | None:
        """The chosen replica's predicted tokens per tier (as `RequestStats.tier_tokens`)."""
        return None if self.from_tiers is None else self.from_tiers[self.index]


def chain_hasher(config: CacheConfig) -> Hasher:
    """The hasher a replica of `config` hashes requests with (`CacheConfig.hasher`)."""
    return config.hasher()


class Router:
    """Mirrors, loads and a policy; `route` picks a replica for a request."""

    def __init__(
        self,
        config: CacheConfig,
        policy: str | Policy = "exact",
        *,
        load_weight: float = DEFAULT_LOAD_WEIGHT,
        tier_prices: Mapping[str, TierPrice] | None = None,
        **policy_options: Any,
    ) -> None:
        """`tier_prices`: by medium, what a load from a replica's tier costs (the module
        docstring; default `DEFAULT_TIER_PRICES`). `policy_options`: `text_threshold`,
        `text_imbalance`, `text_capacity_tokens` (see `kvreuse.fleet.routing.policy.TextPrefix`)."""
        if isinstance(load_weight, bool) or not (
            isinstance(load_weight, int | float) and math.isfinite(load_weight) and load_weight >= 0
        ):
            raise ValueError(f"load_weight must be a finite number ≥ 0, got {load_weight!r}")
        self.config = config
        self.geometry: Geometry = config.geometry
        self.hasher = chain_hasher(config)
        # whether the hasher's chain reads a token list through the native kernel, which
        # refuses what is not a token (the Python encodings are handed checked arrays)
        self._kernel_checks = self.hasher.template.kernel is not None
        self.load_weight = float(load_weight)
        prices = DEFAULT_TIER_PRICES if tier_prices is None else tier_prices
        for medium, price in prices.items():
            if not isinstance(price, TierPrice):
                raise ValueError(f"tier_prices[{medium!r}] must be a TierPrice, got {price!r}")
        self.tier_prices: Mapping[str, TierPrice] = dict(prices)
        self.policy = make_policy(policy, self.geometry, **policy_options)
        self.names: list[str] = []
        self.mirrors: list[ReplicaMirror] = []
        # which replicas hold each key of every full-attention group (the mirrors keep it)
        full = [g.group_id for g in self.geometry.cacheable if g.stage is Stage.FULL]
        self.holders = Holders(full)
        self.load_tokens: list[int] = []
        self.num_requests: list[int] = []

    # ------------------------------------------------------------------ replicas
    def add_replica(
        self,
        name: str,
        mirror: ReplicaMirror | None = None,
        *,
        tiers: Sequence[str] = (),
        shared: Sequence[StoreMirror] = (),
    ) -> ReplicaMirror:
        """Follow a replica; `mirror` is one a `Subscriber` keeps current (default: a new one,
        fed through `apply`, knowing the media `tiers` of the replica's tiers in order, and
        reading the tiers it shares with other replicas from `shared`). Returns the mirror."""
        if name in self.names:
            raise ValueError(f"replica {name!r} is already routed to")
        if mirror is None:
            mirror = ReplicaMirror(
                self.geometry, _default_group(self.geometry), tiers=tiers, shared=shared
            )
        elif mirror.geometry != self.geometry:
            raise ValueError(f"replica {name!r}: its mirror has another geometry than the router")
        self.holders.attach(mirror, len(self.mirrors))
        self.names.append(name)
        self.mirrors.append(mirror)
        self.load_tokens.append(0)
        self.num_requests.append(0)
        self.policy.added(len(self.names) - 1)
        return mirror

    def replace_mirror(self, replica: int, mirror: ReplicaMirror) -> None:
        """Follow a restarted replica through a new mirror (it holds nothing and numbers its
        batches from 0 again)."""
        if mirror.geometry != self.geometry:
            raise ValueError(
                f"replica {self.names[replica]!r}: the new mirror has another geometry"
            )
        self.holders.detach(replica)
        self.holders.attach(mirror, replica)
        self.mirrors[replica] = mirror

    def index(self, name: str) -> int:
        try:
            return self.names.index(name)
        except ValueError:
            raise KeyError(f"unknown replica {name!r}; routed to: {self.names}") from None

    def apply(self, replica: int, events: list[WireEvent]) -> None:
        """Apply a replica's wire events to its mirror (the in-process path)."""
        self.mirrors[replica].apply(events)

    def set_load(self, replica: int, load_tokens: int, num_requests: int) -> None:
        """The replica's load now: the tokens of its unfinished routed requests (prompts, plus the
        output so far where the caller sees it) and their number (the module's rule)."""
        self.load_tokens[replica] = load_tokens
        self.num_requests[replica] = num_requests

    # ------------------------------------------------------------------ requests
    def query(
        self,
        tokens: Sequence[int],
        *,
        request_id: str = "",
        lora: tuple[str, str] | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
        prefix_hashes: Sequence[bytes] = (),
    ) -> Query:
        """Hash a request once, as its replica will (same tokens and extra keys, same chain).

        `prefix_hashes`: the chain's first digests, hashed before with this router's hasher for
        the same leading tokens and extra keys (trusted, as `Request.prefix_hashes` is)."""
        if self._kernel_checks and type(tokens) is list and tokens and not prefix_hashes:
            # the native chain kernel checks every token it hashes as it reads them (a copy
            # saved); the ones after its last unit are checked here. A list it refuses (ints of
            # another type, say numpy's) takes the converting path below, which accepts or
            # names them.
            chain = self._chain(request_id, lora, mm_items, cache_salt)
            try:
                chain.extend(tokens)
                _tokens(tokens[chain.num_units * self.geometry.hash_unit :])
                return Query(request_id, chain, len(tokens), self.geometry.hash_unit)
            except (OverflowError, TypeError, ValueError):
                pass
        tokens = _tokens(tokens)
        if not tokens:
            raise ValueError("a request to route needs at least one token")
        chain = self._chain(request_id, lora, mm_items, cache_salt)
        if prefix_hashes:
            h = self.hasher
            most = max(0, (len(tokens) - h.lookahead) // h.hash_unit)
            if len(prefix_hashes) > most:
                raise ValueError(
                    f"request {request_id!r}: {len(prefix_hashes)} prefix hashes for a prompt of "
                    f"{most} hash units"
                )
            chain.adopt(prefix_hashes)
        chain.extend(tokens)
        return Query(request_id, chain, len(tokens), self.geometry.hash_unit)

    def _chain(
        self,
        request_id: str,
        lora: tuple[str, str] | None,
        mm_items: Sequence[MultiModalItem],
        cache_salt: str | None,
    ) -> Chain:
        try:
            return self.hasher.chain(lora=lora, mm_items=mm_items, cache_salt=cache_salt)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"request {request_id!r}: {exc}") from None

    def route(self, query: Query) -> Decision:
        """Pick a replica for `query` with the policy, from the mirrors and loads as they are."""
        if not self.names:
            raise ValueError("no replica to route to: add_replica first")
        choice = self.policy.choose(self, query)
        index = choice.index
        self.policy.routed(index, query)
        return Decision(
            index=index,
            replica=self.names[index],
            policy=self.policy.name,
            num_tokens=query.num_tokens,
            top=query.top,
            predicted=None if choice.predicted is None else tuple(choice.predicted),
            costs=None if choice.costs is None else tuple(choice.costs),
            from_tiers=None if choice.from_tiers is None else tuple(choice.from_tiers),
        )


def _tokens(tokens: Sequence[int]) -> array[int]:
    """`tokens` as the core's token array; ValueError naming the rule when one is not a token."""
    if type(tokens) is array and tokens.typecode == TOKEN_TYPECODE:
        return tokens
    checked = array(TOKEN_TYPECODE)
    try:  # `fromlist` converts a list in one pass, faster than array(code, list)
        if type(tokens) is list:
            checked.fromlist(tokens)
        else:
            checked.extend(tokens)
    except (OverflowError, TypeError):
        raise ValueError("token ids must be ints in [0, 2**32)") from None
    return checked


def _default_group(geo: Geometry) -> int:
    """Where a mirror puts events without `group_idx` (legacy publishers): the attention group."""
    try:
        return attention_group(geo).group_id
    except ValueError:
        return 0
