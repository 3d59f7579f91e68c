"""Routing policies, behind one interface (`Policy`).

    round-robin      each replica in turn; looks at nothing
    least-loaded     the fewest queued + running tokens
    text-prefix      a prefix tree of the prompts routed to each replica, as Ray Serve's
                     PrefixCacheAffinityRouter keeps (text in, no cache events)
    attention-chain  what a router that indexes the attention group sees (Dynamo's KV router,
                     llm-d, …): the longest contiguous chain of attention blocks on each mirror
    exact            the core's own lookup rules run on each mirror: the tokens the replica
                     would really reuse

`attention-chain` and `exact` minimise the cost `(prompt − predicted) + load_weight × load`
(`cheapest`). Every prediction is capped at the request's `top`. On a replica with tiers below
its pool, `exact` looks up the mirror's layered view (device, then each tier) and adds the price
of the loads its hit needs (`TierPrice`): a device hit is cheapest, then a load, then recompute.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Protocol

from kvreuse.core import Geometry, LookupResult, compute_lookup
from kvreuse.core.spi import tier_hit_tokens, tier_sources
from kvreuse.events import ReplicaMirror, attention_group
from kvreuse.fleet import POLICIES, TEXT_MATCH_THRESHOLD, check_policy
from kvreuse.fleet.routing.query import UNKNOWN_TIER_PRICE, FleetView, Query, TierPrice

# Ray Serve's PrefixCacheAffinityRouter defaults besides the match threshold: its queue
# imbalance fallback is off (an infinite threshold) and its prefix tree evicts nothing.
TEXT_IMBALANCE = math.inf


@dataclass(frozen=True, slots=True)
class Choice:
    """A policy's pick: the replica, the cached tokens it predicts on each replica (None when
    it predicts none), the costs it compared (None when it compared none) and, per replica,
    the tokens of the predicted hit each tier below the pool would give (None without tiers)."""

    index: int
    predicted: list[int] | None = None
    costs: list[float] | None = None
    from_tiers: list[tuple[int, ...]] | None = None


class Policy(Protocol):
    name: str

    def added(self, index: int) -> None:
        """A replica joined the fleet at `index`."""
        ...

    def choose(self, view: FleetView, query: Query) -> Choice:
        """The replica for `query`, the cached tokens predicted on each replica (None when the
        policy does not predict) and the costs it compared (None when it compared none)."""
        ...

    def routed(self, index: int, query: Query) -> None:
        """`query` was sent to replica `index`."""
        ...


class Turn:
    """How ties break: among replicas equal on everything a policy compares, the first one at
    or after the replica after the last one routed to. Sequential traffic with no cache
    advantage anywhere then goes round the fleet, instead of filling the lowest index's cache
    and leaving the others cold (with nothing in flight every load is 0, so a load tie-break
    alone would send every such request to replica 0). It depends only on the routing history,
    so a simulation stays deterministic."""

    def __init__(self) -> None:
        self.next = 0

    def order(self, replica: int, num_replicas: int) -> int:
        """The replica's place in the turn: 0 for the one whose turn it is."""
        return (replica - self.next) % num_replicas

    def routed(self, index: int) -> None:
        self.next = index + 1


def cheapest(
    view: FleetView,
    query: Query,
    predicted: Sequence[int],
    turn: Turn | None = None,
    extra: Sequence[float] | None = None,
) -> tuple[int, list[float]]:
    """The replica of lowest `(prompt − predicted) + extra + load_weight × load` (`extra`: the
    price of its tier loads, none by default); ties go to the lower load, then to the replica
    whose turn it is (`Turn`; without one, the lower index)."""
    w, loads, n = view.load_weight, view.load_tokens, query.num_tokens
    costs = [n - p + w * load for p, load in zip(predicted, loads, strict=True)]
    if extra is not None:
        costs = [c + x for c, x in zip(costs, extra, strict=True)]
    size = len(costs)
    after = turn.next % size if turn is not None else 0  # whose turn it is: rank 0
    # (cost, load) in turn order, from `after` round the fleet: the first minimum wins a tie
    ranked = list(zip(costs, loads, strict=True))
    ranked = ranked[after:] + ranked[:after]
    return (after + ranked.index(min(ranked))) % size, costs


def least_loaded(
    view: FleetView, candidates: Sequence[int] | None = None, turn: Turn | None = None
) -> int:
    """The candidate with the fewest load tokens, then requests, then the one whose turn it is
    (`Turn`; without one, the lowest index)."""
    loads, counts = view.load_tokens, view.num_requests
    size = len(loads)
    pool = range(size) if candidates is None else candidates
    order = turn.order if turn is not None else lambda r, _n: r
    return min(pool, key=lambda r: (loads[r], counts[r], order(r, size)))


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self.next = 0

    def added(self, index: int) -> None:
        pass

    def choose(self, view: FleetView, query: Query) -> Choice:
        return Choice(self.next % len(view.names))

    def routed(self, index: int, query: Query) -> None:
        self.next = index + 1


class LeastLoaded:
    name = "least-loaded"

    def __init__(self) -> None:
        self.turn = Turn()

    def added(self, index: int) -> None:
        pass

    def choose(self, view: FleetView, query: Query) -> Choice:
        return Choice(least_loaded(view, turn=self.turn))

    def routed(self, index: int, query: Query) -> None:
        self.turn.routed(index)


class TextPrefix:
    """Ray Serve's PrefixCacheAffinityRouter, on tokens instead of characters.

    Each replica has a prefix tree of the prompts routed to it (inserted when routed; the tree
    never hears of evictions). A request goes, when queue lengths differ by at most
    `imbalance`, to the replicas of longest match if the match covers at least `threshold` of
    the prompt, else to the replicas of smallest tree; among those, the one with the fewest
    requests. With imbalanced queues it goes to the least loaded (Ray draws a power-of-two pair).

    The tree holds the request's chain hashes, so it matches at the hash unit (a character tree
    matches up to the character) and, because the chain covers the LoRA and the salt, per
    adapter and tenant. `capacity_tokens` bounds each tree (least recently routed first, a
    prefix after its extensions); None keeps everything, Ray's default.
    """

    name = "text-prefix"

    def __init__(
        self,
        threshold: float = TEXT_MATCH_THRESHOLD,
        imbalance: float = TEXT_IMBALANCE,
        capacity_tokens: int | None = None,
        unit: int = 1,
    ) -> None:
        if not (isinstance(threshold, int | float) and 0 <= threshold <= 1):
            raise ValueError(f"text-prefix: threshold must be in [0, 1], got {threshold!r}")
        if not (isinstance(imbalance, int | float) and imbalance >= 0):
            raise ValueError(f"text-prefix: imbalance must be ≥ 0, got {imbalance!r}")
        if capacity_tokens is not None and not (
            type(capacity_tokens) is int and capacity_tokens >= 1
        ):
            raise ValueError(
                f"text-prefix: capacity_tokens must be an int ≥ 1, got {capacity_tokens!r}"
            )
        self.threshold, self.imbalance = threshold, imbalance
        self.capacity_units = None if capacity_tokens is None else max(1, capacity_tokens // unit)
        self.trees: list[OrderedDict[int, None]] = []  # per replica, least recent first
        self.turn = Turn()

    def added(self, index: int) -> None:
        self.trees.append(OrderedDict())

    def choose(self, view: FleetView, query: Query) -> Choice:
        keys, u, top = query.keys, query.unit, query.top
        matches = []
        for tree in self.trees:
            k = 0
            for key in keys:
                if key not in tree:
                    break
                k += 1
            matches.append(k)
        predicted = [min(k * u, top) for k in matches]
        counts = view.num_requests
        if max(counts) - min(counts) > self.imbalance:
            return Choice(least_loaded(view, turn=self.turn), predicted)
        best = max(matches)
        if best * u >= self.threshold * query.num_tokens:
            candidates = [r for r, k in enumerate(matches) if k == best]
        else:
            sizes = [len(t) for t in self.trees]
            smallest = min(sizes)
            candidates = [r for r, s in enumerate(sizes) if s == smallest]
        loads, size, order = view.load_tokens, len(counts), self.turn.order
        best_replica = min(candidates, key=lambda r: (counts[r], loads[r], order(r, size)))
        return Choice(best_replica, predicted)

    def routed(self, index: int, query: Query) -> None:
        self.turn.routed(index)
        tree = self.trees[index]
        for key in reversed(query.keys):  # a prefix ends more recent than its extensions
            tree[key] = None
            tree.move_to_end(key)
        cap = self.capacity_units
        if cap is not None:
            while len(tree) > cap:
                tree.popitem(last=False)


class AttentionChain:
    """The longest contiguous run of the request's blocks in each mirror's attention group,
    ignoring every other group (recurrent states, sliding windows, drafters)."""

    name = "attention-chain"

    def __init__(self, geo: Geometry) -> None:
        try:
            self.gid = attention_group(geo).group_id
        except ValueError:
            raise ValueError("attention-chain needs a full-attention group") from None
        self.turn = Turn()

    def added(self, index: int) -> None:
        pass

    def choose(self, view: FleetView, query: Query) -> Choice:
        keys, u = query.keys, query.unit
        limit = query.top // u
        predicted = []
        for mirror in view.mirrors:
            entries = mirror.entries(self.gid)
            k = 0
            while k < limit and keys[k] in entries:
                k += 1
            predicted.append(k * u)
        index, costs = cheapest(view, query, predicted, self.turn)
        return Choice(index, predicted, costs)

    def routed(self, index: int, query: Query) -> None:
        self.turn.routed(index)


class Exact:
    """The core's lookup (`compute_lookup`) on each mirror: what each replica would reuse.

    A replica that holds none of the request's first attention page cannot reuse a token
    (every hit needs full attention's covering entry in that page), so its lookup is skipped:
    with many replicas most hold nothing of a given request."""

    name = "exact"

    def __init__(self, geo: Geometry) -> None:
        try:
            g = attention_group(geo)
            self.gid: int | None = g.group_id
            self.first_page = g.page_size // geo.hash_unit  # units in the first page
        except ValueError:
            self.gid, self.first_page = None, 0
        # (gid, page) of every full group when only full attention is cached: one fleet walk
        only = geo.only_full and geo.caching_enabled and bool(geo.cacheable)
        self.full_gids = [(g.group_id, g.page_size) for g in geo.cacheable] if only else []
        self.turn = Turn()

    def added(self, index: int) -> None:
        pass

    def choose(self, view: FleetView, query: Query) -> Choice:
        mirrors = view.mirrors
        if not query.top:
            predicted = [0] * len(mirrors)
        elif self.full_gids and not any(map(_MEDIA, mirrors)):
            predicted = self._full_only(view, query)
        else:
            return self._each(view, query)
        index, costs = cheapest(view, query, predicted, self.turn)
        return Choice(index, predicted, costs)

    def _full_only(self, view: FleetView, query: Query) -> list[int]:
        """Every replica's hit in one walk over the fleet's holders (`kvreuse.events.holders`):
        with full attention alone the hit is min(top, F of every group), as `compute_lookup`
        finds it, and F is what the walk computes for every replica at once."""
        top = query.top
        predicted = [top] * len(view.mirrors)
        u, keys, holders = view.geometry.hash_unit, query.keys, view.holders
        for gid, page in self.full_gids:  # with several full groups the lowest F holds
            for slots, f in holders.full_bounds(gid, keys, page, u):
                if f < top:
                    for r in holders.slots_of(slots):
                        if f < predicted[r]:
                            predicted[r] = f
        return predicted

    def _each(self, view: FleetView, query: Query) -> Choice:
        """`compute_lookup` on every replica that may hit (on its layered view when it has
        tiers): the general path, for geometries beyond full attention and for tiers."""
        geo, rid, chain, n = view.geometry, query.request_id, query.chain, query.num_tokens
        mirrors = view.mirrors
        predicted = [0] * len(mirrors)
        prices = [0.0] * len(mirrors)
        tiers = [(0,) * len(m.media) for m in mirrors] if any(m.media for m in mirrors) else None
        gid = self.gid
        head = query.keys[: self.first_page] if gid is not None else []
        # the replicas holding a key of the first page on their device, in one pass
        on_device = view.holders.holding(gid, head) if gid is not None else -1
        for r, mirror in enumerate(mirrors):
            if not (on_device >> r) & 1 and not (
                gid is not None and mirror.media and self._tier_holds(mirror, gid, head)
            ):
                continue
            if not mirror.media:
                predicted[r] = compute_lookup(geo, mirror, rid, chain, n).hit
                continue
            res = compute_lookup(geo, mirror.tiered, rid, chain, n)
            predicted[r] = res.hit
            prices[r] = load_price(geo, res, mirror.media, view.tier_prices)
            if gid is not None and tiers is not None:
                page = geo.groups[gid].page_size
                tiers[r] = tuple(tier_hit_tokens(res, gid, page, len(mirror.media)))
        index, costs = cheapest(view, query, predicted, self.turn, prices if tiers else None)
        return Choice(index, predicted, costs, tiers)

    @staticmethod
    def _tier_holds(mirror: ReplicaMirror, gid: int, head: list[int]) -> bool:
        """Whether a tier below the replica's pool holds a key of the request's first page."""
        for t in range(len(mirror.media)):
            held = mirror.tier_entries(t, gid)
            if any(key in held for key in head):
                return True
        return False

    def routed(self, index: int, query: Query) -> None:
        self.turn.routed(index)


_MEDIA = attrgetter("media")  # a mirror's tier media (one C call per mirror in `any(map(…))`)


def load_price(
    geo: Geometry, res: LookupResult, media: Sequence[str], prices: Mapping[str, TierPrice]
) -> float:
    """The price, in prefill tokens, of the loads a hit found across tiers needs: per tier, the
    tokens its blocks carry (an attention block its page, a state one page of its group), as
    the simulator's cost model counts them, at the tier's `TierPrice`."""
    tokens = [0] * len(media)
    for g, t, _slot in tier_sources(res):
        tokens[t] += geo.groups[g].page_size
    total = 0.0
    for medium, k in zip(media, tokens, strict=True):
        if k:
            price = prices.get(medium, UNKNOWN_TIER_PRICE)
            total += price.per_token * k + price.per_load
    return total


def make_policy(
    policy: str | Policy,
    geo: Geometry,
    *,
    text_threshold: float = TEXT_MATCH_THRESHOLD,
    text_imbalance: float = TEXT_IMBALANCE,
    text_capacity_tokens: int | None = None,
) -> Policy:
    """A policy by name (`POLICIES`), or `policy` itself when it is already one."""
    if not isinstance(policy, str):
        return policy
    text = (text_threshold, text_imbalance, text_capacity_tokens)
    return _BY_NAME[check_policy(policy)](geo, text)


# name -> (geometry, text-prefix's (threshold, imbalance, capacity)) -> policy
_BY_NAME: dict[str, Callable[[Geometry, tuple[float, float, int | None]], Policy]] = {
    "round-robin": lambda geo, text: RoundRobin(),
    "least-loaded": lambda geo, text: LeastLoaded(),
    "text-prefix": lambda geo, text: TextPrefix(*text, geo.hash_unit),
    "attention-chain": lambda geo, text: AttentionChain(geo),
    "exact": lambda geo, text: Exact(geo),
}
if tuple(_BY_NAME) != POLICIES:  # the names are stated once, in kvreuse.fleet
    raise ImportError(f"routing policies built {tuple(_BY_NAME)} differ from {POLICIES}")
