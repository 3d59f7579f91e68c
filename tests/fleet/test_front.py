"""`kvreuse fleet --replicas 3` on 127.0.0.1, the embedded tiny model on its default geometry
(tiny-hybrid-dcp4: attention pages of 128 tokens, recurrent states every 8), serving the agent
workload (8 sessions, interleaved turns) through the official `openai` client.

With `exact`: every session's turns after the first land on the replica that holds its history,
Σ cached over the run is at least 95 % of what one replica with the whole fleet's capacity
reuses (run here too), and every request's predicted cached tokens equal those delivered. The
pools hold the whole run (nothing is evicted), so the prediction must be exact. With
`round-robin` the same workload's reuse is measured and printed beside it.

Real processes: three fleets' worth of replicas start at once (about half a minute on 2 cores).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import httpx
import pytest
from test_front_util import Turn, command, metric, run_agent

pytest.importorskip(
    "torch", reason="the fleet test runs the tiny model: pip install -e '.[engine]'"
)
for _name in ("fastapi", "uvicorn", "openai"):
    pytest.importorskip(
        _name, reason=f"the fleet front needs {_name}: pip install -e '.[server,test]'"
    )

REPLICAS = 3
NUM_BLOCKS = 1024  # per replica: the tiny-hybrid-dcp4 default, far more than the run needs


def _sessions(turns: list[Turn]) -> dict[int, list[Turn]]:
    out: dict[int, list[Turn]] = defaultdict(list)
    for t in turns:
        out[t.session].append(t)
    return out


def test_exact_fleet_of_three_serves_the_agent_workload() -> None:
    fleet = ["fleet", "--replicas", str(REPLICAS), "--port", "0", "--quiet-replicas"]
    fleet += ["--num-blocks", str(NUM_BLOCKS)]
    single = ["serve", "--port", "0", "--num-blocks", str(REPLICAS * NUM_BLOCKS)]
    with contextlib.ExitStack() as stack:  # all start together
        exact_url = stack.enter_context(command([*fleet, "--policy", "exact"], "kvreuse fleet:"))
        rr_url = stack.enter_context(command([*fleet, "--policy", "round-robin"], "kvreuse fleet:"))
        single_url = stack.enter_context(command(single, "kvreuse serve:"))

        exact = run_agent(exact_url)
        alone = run_agent(single_url)
        rr = run_agent(rr_url)
        scrape = httpx.get(f"{exact_url}/metrics").text
        replicas = httpx.get(f"{exact_url}/fleet/replicas").json()["replicas"]

    sums = {name: sum(t.cached for t in run) for name, run in (("exact", exact), ("single", alone))}
    sums["round-robin"] = sum(t.cached for t in rr)
    prompt = sum(t.prompt_tokens for t in exact)
    print(
        f"\nagent workload, 8 sessions x 6 turns, {prompt:,} prompt tokens: Σ cached "
        + ", ".join(f"{k} {v:,} ({v / prompt:.1%})" for k, v in sums.items())
    )

    # every session stays where its history is; the first turns were spread by load
    for session, ts in _sessions(exact).items():
        assert {t.replica for t in ts} == {ts[0].replica}, f"session {session} moved: {ts}"
    assert len({t.replica for t in exact if t.turn == 0}) >= 2
    # the prediction is exact, and the reuse is that of one replica with the fleet's capacity
    assert all(t.predicted == t.cached for t in exact), [
        t for t in exact if t.predicted != t.cached
    ]
    assert sums["single"] > 0 and sums["exact"] >= 0.95 * sums["single"]
    assert sums["round-robin"] <= sums["exact"]
    # the front's metrics say the same
    for row in replicas:
        assert row["mirror_exact"] and row["up"]
        name = row["name"]
        mine = [t for t in exact if t.replica == name]
        assert metric(scrape, "kvreuse:fleet_routed_requests_total", replica=name) == len(mine)
        delivered = sum(t.cached for t in mine)
        for counter in ("delivered_cached_tokens", "predicted_cached_tokens"):
            assert metric(scrape, f"kvreuse:fleet_{counter}_total", replica=name) == delivered
        for direction in ("over", "under"):
            error = metric(
                scrape,
                "kvreuse:fleet_prediction_error_tokens_total",
                replica=name,
                direction=direction,
            )
            assert error == 0
