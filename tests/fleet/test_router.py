"""The router's policies, its cost and its API, on replicas whose mirrors are fed by real cores
(each request runs on a `KVCacheManager`; its events go through `Converter` to the mirror)."""

from __future__ import annotations

import math
from array import array

import pytest

from kvreuse.core import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.core.spi import TOKEN_TYPECODE
from kvreuse.events import Converter, ReplicaMirror
from kvreuse.fleet.routing.router import Router

ATTENTION = CacheConfig(num_blocks=256, groups=[GroupSpec(kind="full", block_size=16)])
HYBRID = CacheConfig(
    num_blocks=256,
    dcp_size=4,
    hash_unit=8,
    groups=[GroupSpec(kind="full", block_size=32), GroupSpec(kind="recurrent", block_size=8)],
)


class Fleet:
    """A router over `n` replicas, each a core whose events feed the router's mirror."""

    def __init__(self, cfg: CacheConfig, n: int, policy: str, **options: float) -> None:
        self.router = Router(cfg, policy, **options)
        self.cores = [KVCacheManager(cfg) for _ in range(n)]
        self.converters = [Converter(cfg.geometry) for _ in range(n)]
        for r in range(n):
            self.router.add_replica(f"r{r}")
        self.num_runs = 0

    def run_on(self, r: int, tokens: list[int]) -> int:
        """Serve `tokens` on replica r (prefill, one token, finish); returns its cached tokens."""
        mgr, rid = self.cores[r], f"q{self.num_runs}"
        self.num_runs += 1
        mgr.add_request(Request(rid, tokens))
        res = mgr.lookup(rid)
        assert mgr.allocate(rid, len(tokens) - res.hit, lookup=res) is not None
        step = mgr.seal_step()
        mgr.commit(step.step_id, {rid: (len(tokens), [5])})
        mgr.finish(rid)
        self.router.apply(r, self.converters[r].convert(mgr.take_events()))
        return res.hit

    def route(self, tokens: list[int]) -> tuple[int, tuple[int, ...] | None]:
        d = self.router.route(self.router.query(tokens, request_id=f"route{self.num_runs}"))
        return d.index, d.predicted


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 30000 + 1 for i in range(n)]


def test_round_robin_takes_each_replica_in_turn_and_predicts_nothing() -> None:
    fleet = Fleet(ATTENTION, 3, "round-robin")
    fleet.run_on(2, prompt(1, 100))
    routed = [fleet.route(prompt(1, 100)) for _ in range(5)]
    assert [r for r, _ in routed] == [0, 1, 2, 0, 1]
    assert all(p is None for _, p in routed)


def test_least_loaded_takes_the_fewest_tokens_then_requests_then_the_lowest_index() -> None:
    fleet = Fleet(ATTENTION, 3, "least-loaded")
    router = fleet.router
    for r, (tokens, requests) in enumerate([(500, 1), (100, 3), (100, 2)]):
        router.set_load(r, tokens, requests)
    assert fleet.route(prompt(1, 50))[0] == 2
    router.set_load(2, 100, 3)
    assert fleet.route(prompt(1, 50))[0] == 1  # same tokens and requests: the lower index


def test_exact_goes_where_the_prefix_is_until_load_outweighs_it() -> None:
    """cost = prompt − predicted + load_weight × load: 160 tokens reused on r1 win over an idle
    r0 until r1 carries more than 160 / load_weight tokens of load."""
    fleet = Fleet(ATTENTION, 2, "exact", load_weight=0.5)
    doc = prompt(3, 160)
    fleet.run_on(1, doc + prompt(4, 30))
    query = doc + prompt(5, 30)
    assert fleet.route(query) == (1, (0, 160))
    fleet.router.set_load(1, 319, 1)  # 0.5 × 319 < 160
    assert fleet.route(query)[0] == 1
    fleet.router.set_load(1, 321, 1)  # 0.5 × 321 > 160
    assert fleet.route(query)[0] == 0
    fleet.router.set_load(1, 320, 1)  # equal costs: the lower load
    assert fleet.route(query)[0] == 0


def test_predictions_stop_at_top_the_last_prompt_token_is_always_computed() -> None:
    fleet = Fleet(ATTENTION, 1, "attention-chain")
    tokens = prompt(6, 64)
    fleet.run_on(0, tokens)
    assert fleet.route(tokens)[1] == (48,)  # 64 − 1 rounded down to 16, not 64


def test_attention_chain_over_predicts_on_a_hybrid_and_exact_does_not() -> None:
    """The attention KV of a shared prefix is resident, its recurrent state is not: the
    attention view promises the prefix, the replica reuses nothing (exact says so)."""
    shared, results = prompt(7, 96), {}
    for policy in ("attention-chain", "exact"):
        fleet = Fleet(HYBRID, 1, policy)
        fleet.run_on(0, shared + prompt(8, 40))
        query = shared + prompt(9, 40)
        _, predicted = fleet.route(query)
        assert predicted is not None
        results[policy] = (predicted[0], fleet.run_on(0, query))
    assert results["attention-chain"] == (96, 0)
    assert results["exact"] == (0, 0)


def test_text_prefix_routes_by_what_it_routed_not_by_what_is_cached() -> None:
    """Ray's rule: a match of at least the threshold goes to the longest match (the fewest
    requests among equals); below it, to the smallest tree. The tree hears of no eviction."""
    fleet = Fleet(ATTENTION, 3, "text-prefix")
    doc = prompt(10, 200)
    first, _ = fleet.route(doc + prompt(11, 20))  # every tree empty: the smallest, r0
    assert first == 0
    index, predicted = fleet.route(doc + prompt(12, 20))
    assert index == 0 and predicted == (192, 0, 0)  # nothing ran: the cache holds nothing
    assert fleet.route(prompt(13, 220))[0] == 1  # no match: the smallest tree
    fleet.router.set_load(0, 10_000, 3)  # r0 busy, but prefix routing ignores load
    assert fleet.route(doc + prompt(14, 20))[0] == 0


def test_text_prefix_below_its_threshold_and_with_imbalanced_queues() -> None:
    fleet = Fleet(ATTENTION, 2, "text-prefix", text_threshold=0.5, text_imbalance=2)
    doc = prompt(15, 64)
    fleet.route(doc + prompt(16, 200))  # r0's tree
    assert fleet.route(doc + prompt(17, 200))[0] == 1  # 64 of 264 < 50 %: the smaller tree
    fleet.router.set_load(0, 0, 5)
    fleet.router.set_load(1, 50, 0)
    assert fleet.route(prompt(18, 300))[0] == 0  # queues differ by 5 > 2: least loaded


def test_text_prefix_capacity_forgets_the_least_recently_routed_prefixes_first() -> None:
    fleet = Fleet(ATTENTION, 1, "text-prefix", text_capacity_tokens=160)
    policy = fleet.router.policy
    a, b = prompt(19, 96), prompt(20, 96)
    fleet.route([*a, 1])
    fleet.route([*b, 1])  # 12 units routed, room for 10: a's last two units go first
    assert fleet.route([*b, 2])[1] == (96,)
    assert fleet.route([*a, 2])[1] == (64,)
    assert len(policy.trees[0]) == 10  # type: ignore[attr-defined]


def test_the_router_hashes_a_request_once_whatever_the_number_of_replicas() -> None:
    fleet = Fleet(HYBRID, 8, "exact")
    calls = []
    hasher = fleet.router.hasher
    original = hasher.chain

    def counting(**extra: object) -> object:
        calls.append(extra)
        return original(**extra)  # type: ignore[arg-type]

    hasher.chain = counting  # type: ignore[method-assign]
    fleet.route(prompt(21, 300))
    assert len(calls) == 1


def test_the_query_chain_is_the_replicas_own() -> None:
    """Same tokens and extra keys, same chain: a salted or LoRA request is hashed as its
    replica hashes it (a router that dropped the salt would predict hits that are not there)."""
    router = Router(HYBRID)
    mgr = KVCacheManager(HYBRID)
    tokens = prompt(22, 100)
    for extra in ({}, {"cache_salt": "tenant"}, {"lora": ("fr", "/a/fr")}):
        query = router.query(tokens, **extra)  # type: ignore[arg-type]
        assert query.chain.hashes == mgr.hasher.hash_units(tokens, **extra)
    assert router.query(tokens).chain.hashes != router.query(tokens, cache_salt="t").chain.hashes


def test_a_subscribers_mirror_is_used_as_is() -> None:
    router = Router(HYBRID)
    mirror = ReplicaMirror(HYBRID.geometry)
    assert router.add_replica("pod-0", mirror) is mirror
    assert router.index("pod-0") == 0
    other = ReplicaMirror(ATTENTION.geometry)
    with pytest.raises(ValueError, match="another geometry"):
        router.add_replica("pod-1", other)
    with pytest.raises(ValueError, match="already routed to"):
        router.add_replica("pod-0")
    with pytest.raises(KeyError, match="unknown replica 'pod-9'"):
        router.index("pod-9")


def test_a_restarted_replica_is_followed_through_a_fresh_mirror() -> None:
    fleet = Fleet(ATTENTION, 2, "exact", load_weight=0.0)
    tokens = prompt(3, 96)
    fleet.run_on(1, tokens)
    assert fleet.route(tokens) == (1, (0, 80))  # replica 1 holds the prefix
    fleet.router.replace_mirror(1, ReplicaMirror(ATTENTION.geometry))  # it restarted empty
    assert fleet.route(tokens)[1] == (0, 0)
    with pytest.raises(ValueError, match="another geometry"):
        fleet.router.replace_mirror(0, ReplicaMirror(HYBRID.geometry))


@pytest.mark.parametrize("weight", [-1, math.nan, math.inf, True, "1"])
def test_a_bad_load_weight_is_one_clear_error(weight: object) -> None:
    with pytest.raises(ValueError, match="load_weight must be a finite number ≥ 0"):
        Router(ATTENTION, load_weight=weight)  # type: ignore[arg-type]


def test_bad_policies_and_requests_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="unknown routing policy 'best'; choose from round-robin"):
        Router(ATTENTION, "best")
    sliding = CacheConfig(
        num_blocks=64, groups=[GroupSpec(kind="sliding", block_size=16, window=32)]
    )
    with pytest.raises(ValueError, match="attention-chain needs a full-attention group"):
        Router(sliding, "attention-chain")
    with pytest.raises(ValueError, match="text-prefix: threshold must be in"):
        Router(ATTENTION, "text-prefix", text_threshold=2)
    router = Router(ATTENTION)
    with pytest.raises(ValueError, match="no replica to route to"):
        router.route(router.query([1, 2, 3]))
    with pytest.raises(ValueError, match="at least one token"):
        router.query([])
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 2\*\*32\)"):
        router.query([1, -2])
    with pytest.raises(ValueError, match="request 'x': cache_salt must be str"):
        router.query([1, 2], request_id="x", cache_salt=5)  # type: ignore[arg-type]


class _Index:
    """An int by `__index__` only (as numpy's are): the converting path takes it."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


@pytest.mark.parametrize("where", [0, 17, 39])  # in the first unit, a later one, the tail
@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "7", None])
def test_a_bad_token_anywhere_in_a_list_is_refused(where: int, bad: object) -> None:
    """A list of tokens is hashed without a copy where the native kernel reads it: every token,
    those it hashes and those after its last unit, is still checked."""
    tokens: list[object] = list(range(40))  # two 16-token units and an 8-token tail
    tokens[where] = bad
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 2\*\*32\)"):
        Router(ATTENTION).query(tokens)  # type: ignore[arg-type]


def test_a_list_hashes_as_its_array_does() -> None:
    router = Router(ATTENTION)
    tokens = list(range(100, 140))
    want = router.query(array(TOKEN_TYPECODE, tokens)).chain.hashes
    assert router.query(tokens).chain.hashes == want
    assert router.query([_Index(t) for t in tokens]).chain.hashes == want  # type: ignore[misc]
    assert router.query(tuple(tokens)).chain.hashes == want
