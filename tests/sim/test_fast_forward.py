"""The simulator's fast-forward (`kvreuse.sched.advance`) against the step-by-step reference.

Random workloads (arrivals, shared prefixes, multi-turn histories, dependencies, pools small
enough to evict and preempt, speculative decoding with random acceptance) run on every preset
family, both paths; the rows, the summary, the timeline (with its evictions) and the KV events of
every step must be identical, and the fast path must draw the same acceptance numbers, request by
request in the same order. Examples follow the Hypothesis profile (tests/conftest.py: `ci` 500,
`slow` 5,000, `dev` 50).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from kvreuse.core import ConfigError, GroupSpec, KVCacheManager, Request, TierSpec
from kvreuse.deployment import Deployment, preset
from kvreuse.sched import FakeEngine, FastForward, Scheduler, ScriptedEngine
from kvreuse.sched.advance import HORIZON
from kvreuse.sim.run import CostModel, SimResult, simulate
from kvreuse.sim.workload import load_workload, random_tokens

# Each family: a preset (or a variant of one) and the token scale its boundaries live at.
FAMILIES: dict[str, tuple[Deployment, int]] = {
    "attention-16": (preset("attention-16"), 16),
    "dcp": (preset("tiny-attention-dcp4"), 8),
    "sliding-hybrid": (preset("tiny-sliding-hybrid"), 16),
    "sliding-hybrid-1024": (preset("sliding-hybrid"), 64),
    "recurrent-hybrid": (preset("tiny-hybrid-dcp4"), 8),
    "hybrid-dcp4": (preset("hybrid-dcp4"), 256),
    "hybrid-dcp4-dense": (preset("hybrid-dcp4-ckpt256"), 256),
    "spec-lookahead": (preset("tiny-spec-lookahead"), 16),
    "spec-drop": (preset("tiny-spec-drop"), 16),
}
_CHUNKED = preset("tiny-sliding-hybrid")
FAMILIES["chunked-hybrid"] = (
    replace(
        _CHUNKED,
        name="chunked-hybrid",
        cache=replace(
            _CHUNKED.cache,
            groups=[
                GroupSpec(kind="full", block_size=16),
                GroupSpec(kind="chunked", block_size=16, chunk=64),
                GroupSpec(kind="recurrent", block_size=16),
            ],
        ),
    ),
    16,
)


@st.composite
def deployments(draw: st.DrawFn, name: str, num_tokens: int, longest: int) -> Deployment:
    """Family `name`'s geometry with random scheduler knobs and cache options, and a pool of
    a random fraction of what the workload's `num_tokens` take, with room for its `longest`
    request alone in most runs (so that runs evict and preempt, and some refuse)."""
    dep, _ = FAMILIES[name]
    cache = dep.cache
    groups = cache.geometry.groups
    page = min(g.page_size for g in groups if g.kind != "recurrent")
    alone = sum(-(-longest // g.page_size) if g.kind == "full" else 2 for g in groups)
    fraction = draw(st.sampled_from([0.1, 0.2, 0.35, 0.6, 3.0]))
    changes: dict[str, Any] = {"num_blocks": 1 + max(alone, int(num_tokens / page * fraction))}
    if draw(st.integers(0, 9)) == 0:
        changes["num_blocks"] = draw(st.integers(2, alone + 1))  # too small for some
    if cache.spec_mode == "lookahead":
        changes["lookahead_tokens"] = draw(st.integers(1, 3))
    if draw(st.integers(0, 9)) == 0:
        changes["enable_prefix_caching"] = False
    if any(g.kind == "recurrent" for g in cache.groups) and draw(st.booleans()):
        changes["recurrent_retention"] = "dense"
    try:
        cache = replace(cache, **changes)
    except ConfigError:
        assume(False)
    spec = dep.sched.num_spec_tokens
    scale = FAMILIES[name][1]
    sched = replace(
        dep.sched,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.sampled_from([8, 64, 512, 8192])) * max(1, scale // 16),
        num_spec_tokens=draw(st.integers(0, 3)) if spec else draw(st.sampled_from([0, 0, 0, 2])),
        chunk_at_save_positions=draw(st.booleans()),
        defer_shared_prefix=draw(st.booleans()),
        max_defer_steps=draw(st.integers(0, 4)),
    )
    assume(1 + sched.num_spec_tokens <= sched.max_num_batched_tokens)
    tiers: tuple[TierSpec, ...] = ()
    if draw(st.booleans()):  # memory tiers below the pool: loads in both paths
        tiers = (TierSpec("host", draw(st.sampled_from([1, 8, 256]))),)
        if draw(st.booleans()):
            tiers += (TierSpec("store", draw(st.sampled_from([2, 64]))),)
    return replace(dep, cache=cache, sched=sched, tiers=tiers)


@st.composite
def workloads(draw: st.DrawFn, scale: int) -> tuple[list[str], int, int]:
    """JSON lines (fresh prompts, prompts on one of two shared prefixes, next turns quoting an
    earlier request's history, `after` dependencies, arrivals together or spread over a few
    decode steps), about how many tokens they take, and the longest request's."""
    prefixes = [draw(st.integers(1, 4 * scale)) for _ in range(2)]
    together = draw(st.booleans())  # a burst: shared prefixes in flight together (deferral)
    lines: list[str] = []
    num_tokens = longest = 0
    for i in range(draw(st.integers(2, 8))):
        length = draw(st.integers(1, 3 * scale))
        own: dict[str, Any] = {"random": {"seed": 100 + i, "len": length}}
        kind = draw(st.sampled_from(["fresh", "shared", "shared", "history"]))
        if together and draw(st.booleans()):
            kind = "shared"
        if kind == "history" and i:
            prompt = {"concat": [{"history": f"r{draw(st.integers(0, i - 1))}"}, own]}
        elif kind != "fresh":
            p = draw(st.integers(0, 1))
            prompt = {"concat": [{"random": {"seed": p, "len": prefixes[p]}}, own]}
            length += prefixes[p]
        else:
            prompt = own
        max_tokens = draw(st.integers(1, 3 * scale))
        arrival = 0.0 if together else draw(st.sampled_from([0.0, 0.01, 0.05, 0.2, 0.5])) * i
        line: dict[str, Any] = {
            "id": f"r{i}",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "arrival": arrival,
        }
        if i and draw(st.integers(0, 5)) == 0:
            line["after"] = f"r{draw(st.integers(0, i - 1))}"
        lines.append(json.dumps(line))
        num_tokens += length + max_tokens
        longest = max(longest, length + max_tokens)
    return lines, num_tokens, longest


COSTS = st.builds(
    CostModel,
    prefill_tokens_per_s=st.sampled_from([1_000.0, 20_000.0, 1e6]),
    decode_step_s=st.sampled_from([0.0, 0.001, 0.02]),
    saved_state_s=st.sampled_from([0.0, 0.003]),
    prefill_chunk_s=st.sampled_from([0.0, 0.002]),
)


@contextmanager
def recorded_draws() -> Iterator[list[tuple[str, int, int, int]]]:
    """Every acceptance draw the engine makes: (request, num, drafts, accepted)."""
    draws: list[tuple[str, int, int, int]] = []
    original = ScriptedEngine.accepted

    def accepted(self: ScriptedEngine, rid: str, num: int, drafts: int) -> int:
        out = original(self, rid, num, drafts)
        draws.append((rid, num, drafts, out))
        return out

    ScriptedEngine.accepted = accepted  # type: ignore[method-assign]
    try:
        yield draws
    finally:
        ScriptedEngine.accepted = original  # type: ignore[method-assign]


def run(
    dep: Deployment, lines: list[str], cost: CostModel, rate: float, fast: bool
) -> tuple[SimResult, list[tuple[int, list[Any]]], list[tuple[str, int, int, int]]]:
    events: list[tuple[int, list[Any]]] = []
    with recorded_draws() as draws:
        result = simulate(
            dep,
            load_workload(lines),
            cost,
            draft_accept_rate=rate,
            fast_forward=fast,
            on_events=lambda step, batch: events.append((step, batch)),
        )
    return result, events, draws


def first_draws(draws: list[tuple[str, int, int, int]]) -> dict[str, list[tuple[int, int, int]]]:
    """Per request, its draws in the order first made (a path may ask for one again)."""
    seen: set[tuple[str, int, int]] = set()
    out: dict[str, list[tuple[int, int, int]]] = {}
    for rid, num, drafts, accepted in draws:
        if (rid, num, drafts) not in seen:
            seen.add((rid, num, drafts))
            out.setdefault(rid, []).append((num, drafts, accepted))
    return out


def assert_same(dep: Deployment, lines: list[str], cost: CostModel, rate: float) -> SimResult:
    """Both paths on one case: everything equal (module docstring); the fast path's result."""
    ref, ref_events, ref_draws = run(dep, lines, cost, rate, fast=False)
    fast, fast_events, fast_draws = run(dep, lines, cost, rate, fast=True)
    assert ref.num_fast_steps == 0
    assert fast.requests == ref.requests
    assert fast.summary == ref.summary
    assert fast.timeline == ref.timeline
    assert fast.evicted == ref.evicted and len(fast.evicted) == len(fast.timeline)
    assert fast_events == ref_events
    # A draw is keyed by (seed, request, position): the fast path makes every draw the reference
    # makes, with the same result, and for a request that ran straight through (no preemption,
    # no refusal) in the same order, plus at most one look-ahead's worth past its end. Where a
    # preemption redid a request's steps, draws made ahead for steps that then went otherwise
    # decided nothing (the rows and events above are equal).
    ref_first, fast_first = first_draws(ref_draws), first_draws(fast_draws)
    straight = {r["id"] for r in ref.requests if not r["preemptions"]}
    straight -= set(ref.summary["too_large"]["ids"])
    for rid, made in ref_first.items():
        ahead = fast_first.get(rid, [])
        assert set(made) <= set(ahead), rid
        if rid in straight:
            assert ahead[: len(made)] == made, rid
            assert len(ahead) - len(made) <= HORIZON + 1, rid
    return fast


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(
    data=st.data(),
    name=st.sampled_from(sorted(FAMILIES)),
    cost=COSTS,
    rate=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
)
def test_fast_forward_equals_step_by_step(
    data: st.DataObject, name: str, cost: CostModel, rate: float
) -> None:
    lines, num_tokens, longest = data.draw(workloads(FAMILIES[name][1]))
    dep = data.draw(deployments(name, num_tokens, longest))
    result = assert_same(dep, lines, cost, rate)
    event(f"family {name}")  # how the examples spread (--hypothesis-show-statistics)
    for what in ("preemptions", "evicted_blocks", "deferral_waits"):
        event(f"{what}: {'some' if result.summary[what] else 'none'}")
    event(f"fast steps: {10 * result.num_fast_steps // max(1, result.summary['steps'])}0 %")
    tiers = result.summary.get("tiers", {})
    loaded = sum(t["loaded_blocks"] for t in tiers.values() if isinstance(t, dict))
    event(f"tier loads: {'some' if loaded else 'none' if dep.tiers else 'no tiers'}")


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_family_decodes_long_enough_to_cross_its_boundaries(name: str) -> None:
    """A fixed run per family that crosses many units and pages while requests arrive, share
    a prefix, quote a history and are evicted: equal on both paths, and most steps taken fast."""
    dep, scale = FAMILIES[name]
    groups = dep.cache.geometry.groups
    alone = sum(-(-13 * scale // g.page_size) if g.kind == "full" else 3 for g in groups)
    dep = replace(dep, cache=replace(dep.cache, num_blocks=1 + 3 * alone))  # about 3 at once
    lines = []
    for i in range(6):
        shared = {"random": {"seed": 1, "len": 3 * scale}}
        own = {"random": {"seed": 10 + i, "len": scale + i}}
        prompt: Any = {"concat": [shared, own]}
        if i == 3:
            prompt = {"concat": [{"history": "r0"}, own]}
        line = {"id": f"r{i}", "prompt": prompt, "max_tokens": 9 * scale + i, "arrival": 0.03 * i}
        lines.append(json.dumps(line))
    result = assert_same(dep, lines, CostModel(saved_state_s=0.001), 0.7)
    assert result.summary["evicted_blocks"] > 0
    assert result.num_fast_steps > 0.8 * result.summary["steps"]


def test_a_long_stretch_keeps_no_finished_request() -> None:
    """A burst taken in one stretch (admissions inside it): the stretch holds a lane per running
    request only, so a long run keeps no finished request alive."""
    dep = preset("hybrid-dcp4")
    mgr = KVCacheManager(replace(dep.cache, enable_events=False))
    engine = FakeEngine()
    sched = Scheduler(mgr, engine, replace(dep.sched, max_num_seqs=4))
    for i in range(40):
        sched.add(Request(f"r{i}", random_tokens(i, 600)), max_tokens=300 + i)
    fast = FastForward(sched, engine)
    assert fast.begin() is False  # nothing runs yet
    sched.step()  # admits the first four
    assert fast.begin()
    finished = 0
    while sched.has_work():
        st = fast.step()
        assert st is not None  # the pool holds everything: the stretch never hands back
        finished += len(st.finished)
        assert len(fast.lanes) == len(sched.running) <= 4
    assert finished == 40
    mgr.check_invariants()
