"""The fleet simulation: one replica is the single-replica simulator, every run reconciles with
every replica's counters and mirrors, exact routing keeps conversations where their history is,
and the shared tier counts what other replicas computed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvreuse.core import TierSpec
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


def test_a_resend_on_another_replica_loads_what_the_first_demoted_to_the_store() -> None:
    """Round-robin over 2 replicas: a document on r0, floods that evict it from r0's pool,
    then its resend, on r1: without a store a miss; with one the replicas share, the whole
    prefix loaded from the store; a smaller store, what it kept of the document's head."""
    doc = rand(5, 640)
    workload = load(
        [
            {"id": "a", "prompt": doc, "max_tokens": 2},
            {"id": "f1", "prompt": rand(6, 640), "max_tokens": 2, "after": "a"},
            {"id": "f2", "prompt": rand(7, 656), "max_tokens": 2, "after": "f1"},
            {"id": "b", "prompt": doc, "max_tokens": 2, "after": "f2"},
        ]
    )
    dep = preset("attention-16")
    dep = replace(dep, cache=replace(dep.cache, num_blocks=43))  # f2 evicts all the document

    def resend(store_blocks: int | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        tiers = () if store_blocks is None else (TierSpec("store", store_blocks),)
        summary, rows = run(replace(dep, tiers=tiers), workload, replicas=2, policy="round-robin")
        assert summary["reconciled"], summary["reconciliation"]
        assert [r["replica"] for r in rows] == ["r0", "r1", "r0", "r1"]
        return summary, rows

    assert resend(None)[1][3]["cached_tokens"] == 0
    summary, rows = resend(100)
    assert rows[3]["cached_tokens"] == 624  # 39 pages of 16; the last token is computed
    assert summary["tiers"]["store"]["hit_tokens"] == 624
    assert summary["per_replica"][1]["cached_tokens"] == 624
    # a pool evicts a chain from its tail: a store of 8 keeps the last 8 demoted, its head
    assert resend(8)[1][3]["cached_tokens"] == 8 * 16


def test_fleet_options_are_checked() -> None:
    with pytest.raises(ValueError, match=r"--replicas must be an int in \[1, 1024\]"):
        FleetOptions(replicas=0)
