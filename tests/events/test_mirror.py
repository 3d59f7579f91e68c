"""A subscriber's mirror predicts exactly the cached tokens the replica then returns.

Each request is predicted from the mirror (the core's lookup run on what the events told the
subscriber) before the replica sees it, then run; the two must agree for every request, on a
DCP4 hybrid, a sliding-window hybrid and the speculative geometries, under eviction too.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from replica import GEOMETRIES, Replica, agent_turns, shared_prefix, sync

from kvreuse.core import CacheConfig, GroupSpec
from kvreuse.events import ReplicaMirror, Subscriber


def replay_workload(replica: Replica, sub: Subscriber, prompts: list[list[int]]) -> list[int]:
    mirror = replica.follow(sub, "r")
    hits = []
    for i, tokens in enumerate(prompts):
        sync(sub, "r", replica.pub)
        predicted = replica.predict(mirror, f"q{i}", tokens)
        cached = replica.run(f"q{i}", tokens, decode=4)
        assert predicted.hit == cached, f"request {i} of {len(tokens)} tokens"
        hits.append(cached)
    sync(sub, "r", replica.pub)
    assert sub.stream("r").exact
    return hits


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize("workload", ["agent", "shared-prefix"])
def test_mirror_predicts_every_cached_tokens(name: str, workload: str) -> None:
    prompts = agent_turns(1) if workload == "agent" else shared_prefix(2)
    replica = Replica(GEOMETRIES[name])
    with Subscriber() as sub:
        try:
            hits = replay_workload(replica, sub, prompts)
        finally:
            replica.close()
    assert sum(hits) > 0  # the workload does reuse: the comparison is not vacuous


def test_mirror_stays_exact_under_eviction() -> None:
    """A pool far smaller than the workload: removals reach the mirror before each lookup."""
    cfg = CacheConfig(
        num_blocks=24,
        dcp_size=4,
        hash_unit=8,
        groups=[GroupSpec(kind="full", block_size=32), GroupSpec(kind="recurrent", block_size=8)],
    )
    replica = Replica(cfg)
    prompts = [p for seed in range(3) for p in agent_turns(seed, 6)]
    with Subscriber() as sub:
        try:
            replay_workload(replica, sub, prompts)
            assert replica.mgr.metrics()["kv_blocks_evicted_total"] > 0
        finally:
            replica.close()


@pytest.mark.parametrize("seed", range(12))
def test_random_histories_keep_the_mirror_exact(seed: int) -> None:
    """Random prompts over a few shared stems, random decode lengths, a pool small enough to
    evict: after every request the mirror holds exactly the replica's entries, and every
    prediction is the cached tokens."""
    rng = random.Random(seed)
    name = sorted(GEOMETRIES)[seed % len(GEOMETRIES)]
    cfg = replace(GEOMETRIES[name], num_blocks=rng.choice([40, 64, 128]))
    stems = [[rng.randrange(1, 500) for _ in range(rng.randrange(20, 120))] for _ in range(3)]
    replica = Replica(cfg)
    with Subscriber() as sub:
        try:
            mirror = replica.follow(sub, "r")
            for i in range(30):
                stem = rng.choice(stems)
                tokens = stem[: rng.randrange(1, len(stem) + 1)]
                tokens += [rng.randrange(1, 500) for _ in range(rng.randrange(0, 40))]
                sync(sub, "r", replica.pub)
                assert entries_by_group(replica) == mirror_by_group(replica, mirror)
                predicted = replica.predict(mirror, f"q{i}", tokens)
                assert predicted.hit == replica.run(f"q{i}", tokens, decode=rng.randrange(0, 9))
            sync(sub, "r", replica.pub)
            assert entries_by_group(replica) == mirror_by_group(replica, mirror)
            assert sub.stream("r").exact
        finally:
            replica.close()


def entries_by_group(replica: Replica) -> dict[int, dict[int, int]]:
    resident: dict[int, dict[int, int]] = {g.group_id: {} for g in replica.cfg.geometry.groups}
    for gid, boundary, key, _kind, _block in replica.mgr.export_entries():
        resident[gid][int.from_bytes(key[-8:], "big")] = boundary
    return resident


def mirror_by_group(replica: Replica, mirror: ReplicaMirror) -> dict[int, dict[int, int]]:
    return {g.group_id: dict(mirror.entries(g.group_id)) for g in replica.cfg.geometry.groups}


def test_mirror_entries_match_the_replica() -> None:
    """Per group, the mirror holds exactly the low 64 bits of the replica's resident keys,
    at their boundaries."""
    replica = Replica(GEOMETRIES["dcp4-hybrid"])
    with Subscriber() as sub:
        try:
            mirror = replica.follow(sub, "r")
            for i, tokens in enumerate(shared_prefix(5)):
                replica.run(f"q{i}", tokens, decode=2)
            sync(sub, "r", replica.pub)
        finally:
            replica.close()
    resident: dict[int, dict[int, int]] = {}
    for gid, boundary, key, _kind, _block in replica.mgr.export_entries():
        resident.setdefault(gid, {})[int.from_bytes(key[-8:], "big")] = boundary
    for gid in range(len(replica.cfg.geometry.groups)):
        assert mirror.entries(gid) == resident.get(gid, {})
