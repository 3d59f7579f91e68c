"""Where no replica has a cache advantage, ties do not always go to the same replica: requests
sent one at a time (nothing in flight, every load 0) go round the fleet, in the router, the live
dispatcher and the simulation alike, and the simulation stays deterministic."""

from __future__ import annotations

import random

import pytest

from kvreuse.deployment import preset
from kvreuse.fleet import POLICIES
from kvreuse.fleet.routing.router import Router
from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet
from kvreuse.sim.workload import parse_line

CFG = preset("attention-16").cache


def unrelated(n: int, length: int = 200) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(1, 30_000) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("policy", POLICIES)
def test_sequential_unrelated_requests_go_round_the_replicas(policy: str) -> None:
    router = Router(CFG, policy)
    for name in ("r0", "r1", "r2"):
        router.add_replica(name)
    chosen = [router.route(router.query(t)).replica for t in unrelated(12)]
    assert chosen == ["r0", "r1", "r2"] * 4


def test_a_cache_advantage_still_wins_over_the_turn() -> None:
    from kvreuse.core import KVCacheManager, Request
    from kvreuse.events import Converter

    router = Router(CFG, "exact")
    for name in ("r0", "r1", "r2"):
        router.add_replica(name)
    doc = unrelated(1, 400)[0]
    mgr = KVCacheManager(CFG)  # replica r1 has computed the document
    mgr.add_request(Request("d", prompt_token_ids=doc))
    plan = mgr.allocate("d", len(doc), mgr.lookup("d"))
    assert plan is not None
    step = mgr.seal_step()
    mgr.commit(step.step_id, {"d": (len(doc), [1])})
    mgr.finish("d")
    router.apply(1, Converter(CFG.geometry).convert(mgr.take_events()))
    again = [router.route(router.query([*doc, 5, 6, 7])).replica for _ in range(3)]
    assert again == ["r1", "r1", "r1"]


def test_the_live_dispatcher_spreads_sequential_requests(tmp_path) -> None:
    pytest.importorskip("zmq")
    from kvreuse.fleet.serving.dispatch import Dispatcher

    dispatcher = Dispatcher(CFG, "exact")
    try:
        for i in range(3):
            dispatcher.add(f"replica-{i}", f"http://127.0.0.1:{9 + i}", f"ipc://{tmp_path}/e{i}")
        chosen = []
        for tokens in unrelated(12):
            routed = dispatcher.route(tokens)
            chosen.append(routed.member.name)
            dispatcher.done(routed)  # answered before the next one is sent
    finally:
        dispatcher.close()
    assert sorted(chosen.count(f"replica-{i}") for i in range(3)) == [4, 4, 4]


def test_the_simulation_spreads_them_and_stays_deterministic() -> None:
    lines = []
    for i, tokens in enumerate(unrelated(9)):
        line = {"id": f"q{i}", "prompt": {"tokens": tokens}, "max_tokens": 2}
        if i:
            line["after"] = f"q{i - 1}"  # one at a time
        lines.append(parse_line(line, i + 1))

    def run() -> list[str]:
        rows: list[dict] = []
        summary, _ = simulate_fleet(
            preset("attention-16"), lines, FleetOptions(3, "exact"), rows.append
        )
        assert summary["reconciled"]
        return [r["replica"] for r in rows]

    first = run()
    assert sorted(first.count(f"r{i}") for i in range(3)) == [3, 3, 3]
    assert run() == first
