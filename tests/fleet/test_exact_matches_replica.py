"""The router's `exact` prediction, from a mirror fed by the replica's own events (the core's
`take_events()` → `Converter.convert` → `Router.apply`), equals the replica's lookup for every
request of random histories: random prompts over shared stems, random decode lengths, pools
small enough to evict, on attention-only, DCP hybrid, sliding-window hybrid and speculative
geometries."""

from __future__ import annotations

import random
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreuse.core import CacheConfig, KVCacheManager, Request
from kvreuse.events import Converter
from kvreuse.fleet.routing.router import Router

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "events"))
from replica import GEOMETRIES as REPLICA_GEOMETRIES

from depth import scaled

# the events tests' geometries, in pools small enough that the histories evict
GEOMETRIES = {
    name: replace(REPLICA_GEOMETRIES[name], num_blocks=num_blocks)
    for name, num_blocks in (
        ("attention", 24),
        ("dcp4-hybrid", 48),
        ("sliding-hybrid", 96),
        ("spec-drop", 96),
    )
}


class Replica:
    """A manager driven request by request, its events applied to a one-replica router."""

    def __init__(self, cfg: CacheConfig, policy: str = "exact") -> None:
        self.mgr = KVCacheManager(cfg)
        self.converter = Converter(cfg.geometry)
        self.router = Router(cfg, policy)
        self.router.add_replica("r0")

    def sync(self) -> None:
        self.router.apply(0, self.converter.convert(self.mgr.take_events()))

    def run(self, rid: str, tokens: list[int], decode: int) -> tuple[int, int]:
        """(predicted by the router, the replica's own lookup), then the request runs."""
        decision = self.router.route(self.router.query(tokens, request_id=rid))
        mgr = self.mgr
        mgr.add_request(Request(rid, tokens))
        res = mgr.lookup(rid)
        if mgr.allocate(rid, len(tokens) - res.hit, lookup=res) is not None:
            step = mgr.seal_step()
            mgr.commit(step.step_id, {rid: (len(tokens), [5])})
            self.sync()
            for i in range(decode):
                if mgr.allocate(rid, 1) is None:
                    break
                step = mgr.seal_step()
                mgr.commit(step.step_id, {rid: (len(tokens) + 1 + i, [6 + i % 7])})
                self.sync()
        mgr.finish(rid)
        self.sync()
        assert decision.predicted is not None
        return decision.predicted[0], res.hit


request = st.tuples(
    st.integers(0, 2),  # stem
    st.floats(0.0, 1.0),  # share of the stem kept
    st.integers(0, 40),  # new tokens after it
    st.integers(0, 8),  # tokens decoded
)


@settings(max_examples=scaled(300), deadline=timedelta(seconds=20))
@given(
    name=st.sampled_from(sorted(GEOMETRIES)),
    seed=st.integers(0, 2**16),
    requests=st.lists(request, min_size=1, max_size=25),
)
def test_exact_prediction_is_the_replicas_lookup(
    name: str, seed: int, requests: list[tuple[int, float, int, int]]
) -> None:
    stems = [
        [(seed * 7 + s * 131 + i * 31) % 500 + 1 for i in range(60 + 30 * s)] for s in range(3)
    ]
    replica = Replica(GEOMETRIES[name])
    for i, (stem, share, extra, decode) in enumerate(requests):
        base = stems[stem]
        tokens = base[: max(1, int(share * len(base)))]
        tokens += [(seed + i * 17 + j * 3) % 500 + 1 for j in range(extra)]
        predicted, hit = replica.run(f"q{i}", tokens, decode)
        assert predicted == hit, f"request {i} ({len(tokens)} tokens) on {name}"


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_the_comparison_is_not_vacuous(name: str) -> None:
    """A fixed history on each geometry reuses and evicts, and every prediction is exact; the
    attention-only view of the same mirror is wrong on the hybrids (so the check can fail)."""
    rng = random.Random(name)
    stems = [[rng.randrange(1, 500) for _ in range(rng.randrange(40, 120))] for _ in range(3)]
    replica, chain_view = Replica(GEOMETRIES[name]), Replica(GEOMETRIES[name], "attention-chain")
    hits, wrong = [], 0
    for i in range(40):
        stem = rng.choice(stems)
        tokens = stem[: rng.randrange(1, len(stem) + 1)] + [
            rng.randrange(1, 500) for _ in range(20)
        ]
        decode = rng.randrange(0, 9)
        predicted, hit = replica.run(f"q{i}", tokens, decode)
        assert predicted == hit
        hits.append(hit)
        seen, actual = chain_view.run(f"q{i}", tokens, decode)
        wrong += seen != actual
    assert sum(hits) > 0
    assert replica.mgr.metrics()["kv_blocks_evicted_total"] > 0
    if name != "attention":
        assert wrong > 0
