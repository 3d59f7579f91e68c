"""The routable mode, judged the way an unmodified attention-only router reads it.

Such a router predicts, for a request, the longest run of leading blocks of its chain that the
replica published in the attention group (its block granularity is the hash unit here). The
prediction is capped at the request's `top` (the last prompt token is always computed), as
the router's block count is compared at its granularity.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from replica import GEOMETRIES, Replica, agent_turns, shared_prefix, sync

from kvreuse.core import CacheConfig
from kvreuse.events import ReplicaMirror, Subscriber, hash64


def router_prediction(replica: Replica, mirror: ReplicaMirror, tokens: list[int]) -> int:
    hashes = replica.mgr.hasher.hash_units(tokens)
    published = mirror.entries(0)
    u = replica.cfg.geometry.hash_unit
    matched = 0
    for h in hashes[1:]:
        if hash64(h) not in published:
            break
        matched += 1
    return min(matched * u, (len(tokens) - 1) // u * u)


def prediction_errors(cfg: CacheConfig, mode: str, prompts: list[list[int]]) -> list[int]:
    """Router prediction minus the cached tokens the replica then returned, per request."""
    replica = Replica(cfg, mode=mode)
    errors = []
    try:
        with Subscriber() as sub:
            mirror = replica.follow(sub, "r")
            for i, tokens in enumerate(prompts):
                sync(sub, "r", replica.pub)
                predicted = router_prediction(replica, mirror, tokens)
                errors.append(predicted - replica.run(f"q{i}", tokens, decode=4))
    finally:
        replica.close()
    return errors


def workload() -> list[list[int]]:
    return [p for seed in range(2) for p in agent_turns(seed, 8)] + shared_prefix(9, 16)


@pytest.mark.parametrize(
    ("name", "num_blocks"),
    [("dcp4-hybrid", 24), ("sliding-hybrid", 40), ("spec-lookahead", 40), ("spec-drop", 1024)],
)
def test_routable_beats_groups_on_hybrids(name: str, num_blocks: int) -> None:
    """Small pools evict states whose attention KV stays; a drafter in drop mode proves its
    last unit only with the next one. `groups` shows an attention-only router those blocks;
    `routable` does not. Between two checkpoints both still over-predict (documented)."""
    cfg = replace(GEOMETRIES[name], num_blocks=num_blocks)
    prompts = workload()
    groups = prediction_errors(cfg, "groups", prompts)
    routable = prediction_errors(cfg, "routable", prompts)
    assert min(groups) >= 0 and min(routable) >= 0  # neither under-predicts here
    assert sum(routable) < sum(groups)


@pytest.mark.parametrize("name", ["attention", "dcp4-hybrid", "sliding-hybrid"])
def test_routable_is_exact_where_recurrent_retention_is_dense(name: str) -> None:
    cfg = replace(GEOMETRIES[name], recurrent_retention="dense")
    assert prediction_errors(cfg, "routable", workload()) == [0] * len(workload())


def test_evicting_the_states_retracts_the_attention_blocks() -> None:
    replica = Replica(GEOMETRIES["dcp4-hybrid"], mode="routable")
    try:
        with Subscriber() as sub:
            mirror = replica.follow(sub, "r")
            for i, tokens in enumerate(agent_turns(3, 4)):
                replica.run(f"q{i}", tokens, decode=4)
            sync(sub, "r", replica.pub)
            assert mirror.entries(0)
            attention_resident = [e for e in replica.mgr.export_entries() if e[0] == 0]
            for block in sorted({e[4] for e in replica.mgr.export_entries() if e[0] == 1}):
                replica.mgr.evict(block)
            replica.pub.publish(replica.mgr.take_events())
            sync(sub, "r", replica.pub)
            # the attention KV is still resident, but nothing can resume without a state
            assert [e for e in replica.mgr.export_entries() if e[0] == 0] == attention_resident
            assert mirror.entries(0) == {}
    finally:
        replica.close()


@pytest.mark.parametrize("mode", ["groups", "legacy", "routable"])
def test_an_attention_only_router_is_exact_on_an_attention_only_replica(mode: str) -> None:
    assert prediction_errors(GEOMETRIES["attention"], mode, workload()) == [0] * len(workload())


def test_routable_reaches_through_a_copied_page_whose_first_keys_were_evicted() -> None:
    """A request that reuses part of a page copies it and keys only the units it computes; the
    copy's earlier units keep their keys on the original page. Once that page is evicted the
    replica still reuses the whole prefix (the lookup finds the copy by a later key), but the
    index, and so `groups`, has a hole there: an attention-only router stops at it. `routable`
    publishes the path through the hole up to every routable boundary."""
    cfg = replace(GEOMETRIES["dcp4-hybrid"], num_blocks=40, recurrent_retention="dense")
    rng = random.Random(0)
    prompt = [rng.randrange(1, 30000) for _ in range(197)]
    turns = []
    for _ in range(4):  # each turn: the previous prompt, an answer, a long new message
        turns.append(prompt)
        prompt = prompt + [6 + i % 7 for i in range(8)]
        prompt += [rng.randrange(1, 30000) for _ in range(328)]
    groups = prediction_errors(cfg, "groups", turns)
    routable = prediction_errors(cfg, "routable", turns)
    assert min(groups) < 0  # the hole: groups shows an attention-only router too little
    assert routable == [0] * len(turns)
