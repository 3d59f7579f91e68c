"""The fleet simulation's replicas step through the fast-forward (`kvreuse.sched.advance`) and
must give what their step-by-step reference gives: the same rows (routing, predictions, TTFT
timings, tier splits), the same summary (hit rates, loads, balance, reconciliation, steps) on
random workloads over every preset family, 1–3 replicas, every policy, with host tiers and a
store the replicas share (on eviction or written through). The strategies are the
single-replica property's (tests/sim/test_fast_forward.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_fast_forward import COSTS, FAMILIES, deployments, workloads

from kvreuse.core import Admission
from kvreuse.deployment import Deployment
from kvreuse.fleet import POLICIES
from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet
from kvreuse.sched import FastForward
from kvreuse.sim.run import CostModel
from kvreuse.sim.workload import load_workload


def _run(dep: Deployment, lines: list[str], options: FleetOptions) -> tuple[dict, list[dict]]:
    return simulate_fleet(dep, load_workload(lines), options)


@contextmanager
def fast_steps() -> Iterator[list[int]]:
    """Counts the steps the fast-forward took (so the property is known to exercise it)."""
    taken = [0]
    original = FastForward.step

    def step(self: FastForward) -> Any:
        st = original(self)
        taken[0] += st is not None
        return st

    FastForward.step = step  # type: ignore[method-assign]
    try:
        yield taken
    finally:
        FastForward.step = original  # type: ignore[method-assign]


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(
    data=st.data(),
    name=st.sampled_from(sorted(FAMILIES)),
    cost=COSTS,
    rate=st.sampled_from([0.0, 0.7, 1.0]),
    replicas=st.integers(1, 3),
    policy=st.sampled_from(sorted(POLICIES)),
    write_through=st.booleans(),
)
def test_a_fleet_of_fast_forwarding_replicas_equals_step_by_step(
    data: st.DataObject,
    name: str,
    cost: CostModel,
    rate: float,
    replicas: int,
    policy: str,
    write_through: bool,
) -> None:
    lines, num_tokens, longest = data.draw(workloads(FAMILIES[name][1]))
    dep = data.draw(deployments(name, num_tokens, longest))
    if write_through:
        rule = Admission.WRITE_THROUGH
        dep = replace(dep, tiers=tuple(
            replace(t, default=rule) if t.name == "store" else t for t in dep.tiers
        ))  # fmt: skip
    options = FleetOptions(replicas, policy, cost=cost, draft_accept_rate=rate)
    ref_summary, ref_rows = _run(dep, lines, replace(options, fast_forward=False))
    with fast_steps() as taken:
        summary, rows = _run(dep, lines, options)
    assert rows == ref_rows
    assert summary == ref_summary
    event(f"fast steps: {10 * taken[0] // max(1, summary['steps'])}0 %")
    event(f"family {name}")
    event(f"store: {'yes' if any(t.name == 'store' for t in dep.tiers) else 'no'}")


def test_the_fleet_takes_most_decode_steps_through_the_fast_forward() -> None:
    """Long decodes on 2 replicas: nearly every step is a fast one, and the run is the same."""
    lines = [
        f'{{"id": "r{i}", "prompt": {{"random": {{"seed": {i}, "len": 40}}}}, "max_tokens": 300, '
        f'"arrival": {0.01 * i}}}'
        for i in range(6)
    ]
    dep = FAMILIES["attention-16"][0]
    options = FleetOptions(2, "exact")
    ref = _run(dep, lines, replace(options, fast_forward=False))
    with fast_steps() as taken:
        got = _run(dep, lines, options)
    assert got == ref
    assert taken[0] >= 0.9 * got[0]["steps"] > 0
