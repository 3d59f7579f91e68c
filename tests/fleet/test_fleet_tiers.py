"""A fleet whose replicas have tiers below their pools, a host tier each and one store they
share: the router's mirror tracks every tier, `exact` predicts the hit and the tier it comes
from exactly, prices a load between a device hit and a recompute, scoring the tiers keeps
sessions where their evicted history is, and a session moved to another replica loads its
history from the store."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvreuse.core import CacheConfig, GroupSpec, KVCacheManager, Request, TierSpec
from kvreuse.deployment import Deployment, preset
from kvreuse.events import Converter
from kvreuse.fleet.routing.query import TierPrice
from kvreuse.fleet.routing.router import Router
from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet
from kvreuse.sim.generators import agent, shared_prefix
from kvreuse.sim.run import simulate
from kvreuse.sim.workload import WorkloadRequest, parse_line

TIERS = (TierSpec("host", 24, medium="CPU"), TierSpec("store", 144))  # one store: the fleet's


def load(lines: list[dict[str, Any]]) -> list[WorkloadRequest]:
    return [parse_line(line, i) for i, line in enumerate(lines, 1)]


def tiered(name: str, num_blocks: int, tiers: tuple[TierSpec, ...] = TIERS) -> Deployment:
    dep = preset(name)
    return replace(dep, cache=replace(dep.cache, num_blocks=num_blocks), tiers=tiers)


def run(dep: Deployment, workload: list[WorkloadRequest], **options: Any) -> tuple[Any, Any]:
    rows: list[dict[str, Any]] = []
    summary, _ = simulate_fleet(dep, workload, FleetOptions(**options), sink=rows.append)
    return summary, rows


WORKLOAD = load(agent(6, 5, 120, 60, 8, seed=2) + shared_prefix(200, 40, 8, 2, seed=5))


def test_one_tiered_replica_is_the_single_tiered_simulator() -> None:
    """The same tiers, loads and cost model as `kvreuse simulate --host-capacity`: each request
    gets the same cached tokens and TTFT estimate, and the tiers the same totals."""
    dep = tiered("tiny-hybrid-dcp4", 40)
    single = simulate(dep, WORKLOAD)
    summary, rows = run(dep, WORKLOAD, replicas=1)
    assert summary["reconciled"], summary["reconciliation"]
    for mine, theirs in zip(rows, single.requests, strict=True):
        for key in ("id", "cached_tokens", "ttft_estimate_s"):
            assert mine[key] == theirs[key], (key, mine, theirs)
    theirs = single.summary["tiers"]
    for name in ("host", "store"):
        for key in ("hit_tokens", "loaded_blocks", "load_seconds"):
            assert summary["tiers"][name][key] == theirs[name][key], (name, key)
    assert summary["tiers"]["host"]["hit_tokens"] > 0


def spaced_sessions() -> list[WorkloadRequest]:
    """9 agent sessions taken turn by turn (every session's first turn, then every second
    one, …), 100 s apart: each request is routed on an idle fleet, after the other sessions'
    turns have pushed its history down the replica's tiers."""
    lines = agent(9, 6, 150, 80, 8, seed=2)
    lines.sort(key=lambda line: (int(line["id"].split("-t")[1]), line["id"]))
    for i, line in enumerate(lines):
        line["arrival"] = i * 100.0
    return load(lines)


@pytest.mark.parametrize(
    ("name", "num_blocks"), [("tiny-hybrid-dcp4", 16), ("tiny-sliding-hybrid", 180)]
)
def test_the_router_predicts_each_tier_exactly(name: str, num_blocks: int) -> None:
    """3 replicas, small pools, both tiers evicting: every mirror holds each tier's keys
    (reconciled), and with nothing in flight when a request is routed, the router's predicted
    hit and its split across the tiers are exactly what the replica delivers. The sliding
    hybrid's pool lets every turn run cold (a turn that fits only thanks to its hit is refused:
    docs/decisions.md D98)."""
    dep = tiered(name, num_blocks)
    summary, rows = run(dep, spaced_sessions(), replicas=3, policy="exact")
    assert summary["reconciled"], summary["reconciliation"]
    assert any(k.endswith("_mirror_tiers_equal_replica") for k in summary["reconciliation"])
    tiers = summary["tiers"]
    assert tiers["host"]["hit_tokens"] > 0 and tiers["store"]["hit_tokens"] > 0
    admitted = [r for r in rows if r["reason"] != "not_admitted"]
    assert sum(any(r["delivered_tiers"]) for r in admitted) >= 8
    for row in admitted:
        assert row["predicted_tiers"] == row["delivered_tiers"], row
        assert row["predicted_tokens"] == row["cached_tokens"], row
    assert tiers["host"]["predicted_hit_tokens"] == tiers["host"]["delivered_hit_tokens"]
    assert tiers["split_mismatched_without_eviction"] == 0


def test_a_session_moved_to_another_replica_loads_its_history_from_the_store() -> None:
    """Round-robin moves every turn of 8 sessions to another of 3 replicas, whose small pools
    keep nothing between turns: without a store no moved turn reuses anything; with one they
    share, the moved turns load the session's history from it (what another replica demoted),
    and the store's mirror equals the store."""
    lines = agent(8, 5, 150, 80, 8, seed=2)
    lines.sort(key=lambda line: (int(line["id"].split("-t")[1]), line["id"]))
    for i, line in enumerate(lines):
        line["arrival"] = i * 100.0
    workload = load(lines)

    def moved_hits(tiers: tuple[TierSpec, ...]) -> tuple[dict[str, Any], list[int]]:
        summary, rows = run(
            tiered("tiny-hybrid-dcp4", 16, tiers), workload, replicas=3, policy="round-robin"
        )
        assert summary["reconciled"], summary["reconciliation"]
        last: dict[str, str] = {}
        hits = []
        for row in rows:
            session = row["id"].split("-t")[0]
            if last.get(session, row["replica"]) != row["replica"]:
                hits.append(row["cached_tokens"])
            last[session] = row["replica"]
        return summary, hits

    _, alone = moved_hits(())
    summary, shared = moved_hits((TierSpec("store", 200),))
    assert len(alone) == len(shared) == 32  # every turn after the first moved
    assert not any(alone)
    assert sum(h > 0 for h in shared) >= 20
    store = summary["tiers"]["store"]
    assert store["shared"] and store["hit_tokens"] == sum(shared) > 0
    assert any(k.endswith("_mirror_tiers_equal_replica") for k in summary["reconciliation"])


def test_device_only_routing_ignores_the_tiers() -> None:
    dep = tiered("tiny-hybrid-dcp4", 48)
    summary, rows = run(dep, WORKLOAD, replicas=3, policy="exact", score_tiers=False)
    assert summary["reconciled"], summary["reconciliation"]
    assert not any("tiers_equal" in k for k in summary["reconciliation"])
    assert all(r["predicted_tiers"] is None for r in rows)
    assert summary["tiers"]["host"]["predicted_hit_tokens"] is None


def test_scoring_the_tiers_keeps_sessions_where_their_history_is() -> None:
    """Long sessions on small pools: a session's earlier turns leave the device for the host
    between turns. A router that sees only the devices spreads such turns; one that sees the
    tiers sends them back and loads the history, so the fleet reuses more."""
    dep = tiered("tiny-hybrid-dcp4", 24, (TierSpec("host", 400, medium="CPU"),))
    workload = load(agent(12, 6, 200, 100, 8, seed=7))
    aware, _ = run(dep, workload, replicas=3, policy="exact")
    blind, _ = run(dep, workload, replicas=3, policy="exact", score_tiers=False)
    assert aware["reconciled"] and blind["reconciled"]
    assert aware["cached_tokens"] > blind["cached_tokens"]
    assert aware["tiers"]["host"]["hit_tokens"] > 0


# ------------------------------------------------------------------ the price of a load
CFG = CacheConfig(num_blocks=12, groups=[GroupSpec(kind="full", block_size=4)])


def _serve(mgr: KVCacheManager, rid: str, tokens: list[int]) -> None:
    mgr.add_request(Request(rid, tokens))
    res = mgr.lookup(rid)
    assert mgr.allocate(rid, len(tokens) - res.hit, lookup=res) is not None
    step = mgr.seal_step()
    mgr.commit(step.step_id, {rid: (len(tokens), [7])})
    mgr.finish(rid)


def test_a_device_hit_beats_a_load_which_beats_a_recompute() -> None:
    prompt = list(range(1, 42))  # 10 pages of 4, then the last token
    price = TierPrice(per_token=0.25, per_load=3.0)
    router = Router(replace(CFG, enable_events=True), "exact", tier_prices={"CPU": price})
    managers = []
    for name in ("device", "host", "cold"):
        mgr = KVCacheManager(
            replace(CFG, enable_events=True), tiers=[TierSpec("host", 64, medium="CPU")]
        )
        router.add_replica(name, tiers=["CPU"])
        managers.append(mgr)
    _serve(managers[0], "a", prompt)
    _serve(managers[1], "a", prompt)
    _serve(managers[1], "flood", [900 + i for i in range(44)])  # a's pages go to the host
    for r, mgr in enumerate(managers):
        router.apply(r, Converter(mgr.geo).convert(mgr.take_events()))
    query = router.query(prompt, request_id="again")
    decision = router.route(query)
    assert decision.predicted == (40, 40, 0)
    assert decision.from_tiers == ((0,), (40,), (0,))
    assert decision.costs is not None
    n = len(prompt)
    assert decision.costs[0] == n - 40
    assert decision.costs[1] == pytest.approx(n - 40 + 0.25 * 40 + 3.0)
    assert decision.costs[2] == n
    assert decision.replica == "device"
    # without the device copy, the load wins over recomputing
    managers[0].reset()
    router.apply(0, Converter(managers[0].geo).convert(managers[0].take_events()))
    again = router.route(router.query(prompt, request_id="third"))
    assert again.replica == "host" and again.predicted_tiers == (40,)


def test_a_bad_tier_price_is_one_line() -> None:
    with pytest.raises(ValueError, match="per_token must be a finite number"):
        TierPrice(per_token=-1)
    with pytest.raises(ValueError, match=r"tier_prices\['CPU'\] must be a TierPrice"):
        Router(CFG, "exact", tier_prices={"CPU": 0.1})  # type: ignore[dict-item]
