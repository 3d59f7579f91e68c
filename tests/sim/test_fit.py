"""The fit rule (`kvreuse.sched.fit.peak_blocks`) against what a lone request really holds.

A request runs alone on a pool too large to run dry; an engine between the scheduler and the
core reads, at every step, the blocks the request holds once the step is allocated (the pool's
used blocks less the step's own saves, which are best effort). The rule must equal the largest
such count for an engine that writes a state at every unit boundary a step crosses, must not
fall below it for one that writes only at the step's end or accepts drafts, and the request
must run to its end on a pool of exactly peak + 1 blocks (the null block is never handed out).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from depth import scaled
from kvreuse import GroupSpec, KVCacheManager, Request
from kvreuse.core import CacheConfig, StepPlan
from kvreuse.deployment import PRESETS, Deployment, preset
from kvreuse.sched import PositionalTokens, Scheduler, SchedulerConfig, ScriptedEngine, peak_blocks
from kvreuse.sched.engine import SavePolicy
from kvreuse.sched.fit import first_save_positions

G = GroupSpec


def _custom(name: str, groups: list[GroupSpec], **cache: Any) -> Deployment:
    """Geometries the presets lack: a chunked window, two windows, a dense retention."""
    return Deployment(
        name, CacheConfig(groups=groups, num_blocks=64, **cache), SchedulerConfig(), None
    )


DEPLOYMENTS = [preset(name) for name in PRESETS] + [
    _custom("chunked", [G("full", 16), G("chunked", 32, chunk=64)], dcp_size=4),
    _custom(
        "windows",
        [G("sliding", 16, window=20), G("chunked", 32, chunk=96), G("recurrent", 16)],
    ),
    _custom("dense", [G("full", 16), G("recurrent", 32)], recurrent_retention="dense"),
]


class Meter(ScriptedEngine):
    """An engine that records the most blocks the request holds at any step."""

    def __init__(self, mgr: KVCacheManager, saves: SavePolicy, accept_rate: float) -> None:
        super().__init__(PositionalTokens(32000), saves, accept_rate, 0)
        self.mgr = mgr
        self.peak = 0

    def __call__(self, step: StepPlan, seqs: Any) -> Any:
        saves = sum(len(p.saves) for p in step.requests)
        used = self.mgr.config.num_blocks - 1 - self.mgr.num_free_blocks
        self.peak = max(self.peak, used - saves)
        return super().__call__(step, seqs)


def _run(dep: Deployment, num_blocks: int, prompt: int, max_tokens: int, **engine: Any) -> Any:
    """Run one request alone; (finish reason, the engine's peak). The scheduler's own fit check
    is turned off, so a request too large for the pool shows itself by preempting itself."""
    mgr = KVCacheManager(replace(dep.cache, num_blocks=num_blocks))
    meter = Meter(mgr, **engine)
    sched = Scheduler(mgr, meter, dep.sched)
    seq = sched.add(Request("r", [(7 * i) % 997 for i in range(prompt)]), max_tokens=max_tokens)
    seq.too_large = False
    while sched.has_work():
        sched.step()
        mgr.check_invariants()
    return seq.finish_reason, meter.peak, seq.preemptions


@st.composite
def lone_requests(draw: st.DrawFn) -> tuple[Deployment, int, int]:
    dep = draw(st.sampled_from(DEPLOYMENTS))
    drafts = dep.sched.num_spec_tokens
    budget = draw(st.sampled_from([dep.sched.max_num_batched_tokens, 37, 256]))
    dep = replace(dep, sched=replace(dep.sched, max_num_batched_tokens=max(budget, 1 + drafts)))
    edge = st.sampled_from([1, 2, 15, 16, 17, 63, 64, 65, 1023, 1024, 1025])
    prompt = draw(edge | st.integers(1, 3000))
    max_tokens = draw(st.sampled_from([1, 2, 3]) | st.integers(1, 200))
    return dep, prompt, max_tokens


def _roomy(dep: Deployment, prompt: int, max_tokens: int) -> int:
    """A pool that never runs dry for this request: twice the upper bound, and then some."""
    return 2 * dep.cache.blocks_for_request(prompt + max_tokens, dep.sched.num_spec_tokens) + 64


@settings(max_examples=scaled(40), deadline=None)
@given(lone_requests())
def test_the_peak_is_what_a_lone_request_holds(case: tuple[Deployment, int, int]) -> None:
    dep, prompt, max_tokens = case
    peak = peak_blocks(dep.cache.geometry, dep.sched, prompt, max_tokens)
    roomy = _roomy(dep, prompt, max_tokens)
    every = _run(dep, roomy, prompt, max_tokens, saves="up_to_end", accept_rate=0.0)
    assert every[0] != "too_large" and every[1] == peak
    # an engine that writes states only at a step's end holds fewer rolling states, at most
    # κ + 1 per recurrent group fewer; accepted drafts skip steps: never more than the rule
    geo = dep.cache.geometry
    slack = (geo.kappa + 1) * len(geo.recurrent)
    at_end = _run(dep, roomy, prompt, max_tokens, saves="at_end", accept_rate=0.0)
    assert peak - slack <= at_end[1] <= peak
    drafted = _run(dep, roomy, prompt, max_tokens, saves="at_end", accept_rate=0.7)
    assert drafted[1] <= peak
    # and the rule's pool is enough: the request runs to its end without preempting itself
    for saves in ("up_to_end", "at_end"):
        reason, _, preemptions = _run(
            dep, peak + 1, prompt, max_tokens, saves=saves, accept_rate=0.0
        )
        assert reason == "length" and preemptions == 0


@settings(max_examples=scaled(200), deadline=None)
@given(st.sampled_from(DEPLOYMENTS), st.integers(1, 5000))
def test_prefill_chunks_end_where_the_core_saves_on_a_first_run(dep: Deployment, n: int) -> None:
    """`first_save_positions` is the manager's `save_positions` of a request admitted cold."""
    mgr = KVCacheManager(replace(dep.cache, num_blocks=_roomy(dep, n, 1)))
    mgr.add_request(Request("r", [(3 * i) % 991 for i in range(n)]))
    res = mgr.lookup("r")
    assert res.hit == 0
    assert first_save_positions(dep.cache.geometry, n) == mgr.save_positions("r", res)


def test_a_request_that_needs_one_block_more_than_the_pool_is_refused_before_it_runs() -> None:
    dep = preset("tiny-sliding-hybrid")
    peak = peak_blocks(dep.cache.geometry, dep.sched, 12_000, 16)
    for num_blocks, refused in ((peak + 1, False), (peak, True)):
        mgr = KVCacheManager(replace(dep.cache, num_blocks=num_blocks))
        sched = Scheduler(mgr, ScriptedEngine(PositionalTokens(32000), "at_end"), dep.sched)
        seq = sched.add(Request("r", [i % 500 for i in range(12_000)]), max_tokens=16)
        assert seq.too_large is refused
        while sched.has_work():
            sched.step()
        assert (seq.finish_reason == "too_large") is refused
