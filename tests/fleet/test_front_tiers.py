"""`kvreuse fleet` whose replicas keep a host tier below their pools (`-- --host-capacity`):
replica processes publish their tiers' keys in KV events, the front's mirrors track them, and
`exact` routes each session back to the replica whose host holds its history, predicting
every hit, tier loads included, exactly.

Two fleets of 2 fake replicas with pools too small for the agent workload's histories
(24 blocks of 64-token pages), one with host tiers and one without, run side by side."""

from __future__ import annotations

import contextlib

import httpx
import pytest
from test_front_util import command, metric, run_agent

for _name in ("fastapi", "uvicorn", "openai"):
    pytest.importorskip(
        _name, reason=f"the fleet front needs {_name}: pip install -e '.[server,test]'"
    )

FLEET = ["fleet", "--replicas", "2", "--port", "0", "--quiet-replicas", "--fake"]
FLEET += ["--num-blocks", "24", "--policy", "exact"]
HOST = '{medium="CPU",tier="host"}'


def test_a_fleet_routes_sessions_to_the_history_on_a_replicas_host() -> None:
    with contextlib.ExitStack() as stack:
        tiered = stack.enter_context(
            command([*FLEET, "--", "--host-capacity", "100K"], "kvreuse fleet:")
        )
        plain = stack.enter_context(command(FLEET, "kvreuse fleet:"))
        with_host = run_agent(tiered)
        without = run_agent(plain)
        replicas = httpx.get(f"{tiered}/fleet/replicas").json()["replicas"]
        from_host = sum(
            metric(httpx.get(f"{row['url']}/metrics").text, "kvreuse:kv_tier_hits_total",
                   medium="CPU", tier="host")
            for row in replicas
        )  # fmt: skip
        front = httpx.get(f"{tiered}/metrics").text
    # every prediction, tier loads included, is what the replica delivered
    assert [t for t in with_host if t.predicted != t.cached] == []
    assert all(row["mirror_exact"] and row["up"] for row in replicas)
    # the small pools evicted the histories; the hosts gave them back
    cached = sum(t.cached for t in with_host)
    assert 0 < from_host <= cached
    assert cached > sum(t.cached for t in without)
    for row in replicas:
        mine = [t for t in with_host if t.replica == row["name"]]
        routed = metric(front, "kvreuse:fleet_routed_requests_total", replica=row["name"])
        assert routed == len(mine)
