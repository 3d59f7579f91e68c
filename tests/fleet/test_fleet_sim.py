"""The fleet simulation: one replica is the single-replica simulator, every run reconciles with
every replica's counters and mirrors, exact routing keeps conversations where their history is,
and the shared tier counts what other replicas computed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvreuse.deployment import Deployment, preset
from kvreuse.fleet import POLICIES
from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet
from kvreuse.sim.generators import agent, shared_prefix
from kvreuse.sim.run import simulate
from kvreuse.sim.workload import WorkloadRequest, parse_line


def load(lines: list[dict[str, Any]]) -> list[WorkloadRequest]:
    return [parse_line(line, i) for i, line in enumerate(lines, 1)]


def rand(seed: int, n: int) -> dict[str, Any]:
    return {"random": {"seed": seed, "len": n}}


def run(
    dep: Deployment, workload: list[WorkloadRequest], **options: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    summary, kept = simulate_fleet(dep, workload, FleetOptions(**options), sink=rows.append)
    assert kept == []  # the rows went to the sink, in workload order
    assert [r["id"] for r in rows] == [w.request_id for w in workload]
    return summary, rows


@pytest.mark.parametrize("policy", POLICIES)
def test_one_replica_is_the_single_replica_simulator(policy: str) -> None:
    """Same scheduler, same cost model, same clock: every request gets the same cached tokens
    and the same TTFT estimate as `kvreuse simulate`, whatever the policy."""
    dep = preset("tiny-hybrid-dcp4")
    workload = load(agent(3, 4, 40, 24, 8) + shared_prefix(300, 20, 5, 4, seed=9))
    single = simulate(dep, workload).requests
    summary, rows = run(dep, workload, replicas=1, policy=policy)
    assert summary["reconciled"], summary["reconciliation"]
    for mine, theirs in zip(rows, single, strict=True):
        for key in ("id", "prompt_tokens", "cached_tokens", "output_tokens", "ttft_estimate_s"):
            assert mine[key] == theirs[key], (key, mine, theirs)
    assert summary["cached_tokens"] == sum(r["cached_tokens"] for r in single) > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_reconciles_on_three_replicas(policy: str) -> None:
    """Per replica Σ cached = Δ hits, Σ prompts = Δ queries, the audit passes and the router's
    mirror holds exactly the replica's entries; the balance adds up to the prompts routed."""
    tiny = preset("tiny-hybrid-dcp4")
    dep = replace(tiny, cache=replace(tiny.cache, num_blocks=48))
    workload = load(agent(4, 5, 200, 100, 8) + shared_prefix(300, 60, 12, 2, seed=3))
    summary, rows = run(dep, workload, replicas=3, policy=policy)
    assert summary["reconciled"], summary["reconciliation"]
    assert summary["requests"] == len(workload)
    routed = summary["balance"]["routed_prompt_tokens"]
    assert sum(routed) == summary["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert sorted({r["replica"] for r in rows}) == ["r0", "r1", "r2"]
    assert sum(p["evicted_blocks"] for p in summary["per_replica"]) > 0  # under pressure too
    if policy in ("round-robin", "least-loaded"):
        assert summary["prediction"] is None
    else:
        assert summary["prediction"]["requests"] == len(workload)


def test_exact_keeps_every_conversation_on_the_replica_holding_it() -> None:
    """8 agent sessions, interleaved turns, 3 replicas: with exact every turn after the first
    lands where the session's history is, and the fleet reuses at least 95 % of what one
    replica with the whole fleet's capacity reuses; round-robin reuses less."""
    dep = preset("hybrid-dcp4")
    workload = load(agent(8, 6, 600, 300, 24))
    summary, rows = run(dep, workload, replicas=3, policy="exact")
    where = {r["id"]: r["replica"] for r in rows}
    for s in range(8):
        assert len({where[f"s{s}-t{t}"] for t in range(6)}) == 1, f"session {s}"
    big = replace(dep, cache=replace(dep.cache, num_blocks=3 * (dep.cache.num_blocks - 1) + 1))
    one = simulate(big, workload).summary["hits"]
    assert summary["cached_tokens"] >= 0.95 * one > 0
    spread, _ = run(dep, workload, replicas=3, policy="round-robin")
    assert spread["cached_tokens"] < summary["cached_tokens"]
    p = summary["prediction"]
    assert p["over_predicted"] == 0 and p["mismatched_without_eviction"] == 0


def test_the_shared_tier_counts_what_another_replica_computed() -> None:
    """Round-robin sends a resend to the other replica: locally a miss, from the tier the
    whole prefix; a tier too small to hold the document gives nothing."""
    dep = preset("attention-16")
    doc = rand(5, 640)
    workload = load(
        [
            {"id": "a", "prompt": doc, "max_tokens": 2},
            {"id": "b", "prompt": doc, "max_tokens": 2, "after": "a"},
        ]
    )
    summary, rows = run(dep, workload, replicas=2, policy="round-robin", shared_tier_tokens=10_000)
    assert [r["cached_tokens"] for r in rows] == [0, 0]
    assert [r["tier_tokens"] for r in rows] == [0, 624]
    tier = summary["shared_tier"]
    assert tier["tier_tokens"] == 624 and tier["hit_rate_with_tier"] == 624 / 1280
    small, rows = run(dep, workload, replicas=2, policy="round-robin", shared_tier_tokens=64)
    assert [r["tier_tokens"] for r in rows] == [0, 0]  # its first units were evicted
    assert small["shared_tier"]["units_evicted"] > 0


def test_the_shared_tier_is_refused_on_a_hybrid() -> None:
    with pytest.raises(ValueError, match="only prefix-cacheable group is full attention"):
        simulate_fleet(
            preset("hybrid-dcp4"),
            load([{"id": "a", "prompt": rand(1, 10), "max_tokens": 1}]),
            FleetOptions(replicas=2, shared_tier_tokens=1000),
        )


def test_fleet_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"--replicas must be an int in \[1, 1024\]"):
        FleetOptions(replicas=0)
