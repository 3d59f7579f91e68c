"""The scheduler over the core: budget, max_num_seqs, chunking at save positions, preemption and
re-admission, aborts, speculative decoding, and deferral of requests whose prefix is in flight."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.deployment import preset
from kvreuse.sched import FakeEngine, Scheduler, SchedulerConfig, token_at

HYBRID = dict(
    dcp_size=4,
    hash_unit=256,
    groups=[GroupSpec(kind="full", block_size=2048), GroupSpec(kind="recurrent", block_size=256)],
)
SMALL = dict(
    dcp_size=4,
    groups=[GroupSpec(kind="full", block_size=16), GroupSpec(kind="recurrent", block_size=16)],
)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(n)]


def drain(sched: Scheduler, max_steps: int = 10_000) -> list:
    steps = []
    while sched.has_work():
        steps.append(sched.step())
        sched.mgr.check_invariants()
        assert len(steps) < max_steps, "the scheduler made no progress"
    return steps


def reconcile(sched: Scheduler) -> None:
    m = sched.mgr.metrics()
    assert m["prefix_cache_hits"] == sum(s.cached_tokens or 0 for s in sched.seqs.values())
    assert m["prefix_cache_requests"] == sum(
        s.cached_tokens is not None for s in sched.seqs.values()
    )
    assert m["kv_usage"] == 0


def test_budget_and_max_num_seqs_are_respected() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=4096, **SMALL))
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=100)
    sched = Scheduler(mgr, FakeEngine(), cfg)
    for i in range(8):
        sched.add(Request(f"r{i}", tokens(150, i)), max_tokens=5)
    running_max = 0
    while sched.has_work():
        st = sched.step()
        mgr.check_invariants()
        running_max = max(running_max, len(sched.running))
        assert st.num_scheduled_tokens <= 100
    assert running_max == 3
    assert all(len(s.output) == 5 for s in sched.seqs.values())
    reconcile(sched)


def test_generated_tokens_are_deterministic_per_request() -> None:
    outs = []
    for blocks in (4096, 20):  # the second pool forces preemptions during decode
        mgr = KVCacheManager(CacheConfig(num_blocks=blocks, **SMALL))
        sched = Scheduler(mgr, FakeEngine(), SchedulerConfig(max_num_batched_tokens=256))
        for i in range(6):
            sched.add(Request(f"r{i}", tokens(120, i)), max_tokens=40)
        drain(sched)
        reconcile(sched)
        outs.append({rid: s.output for rid, s in sched.seqs.items()})
        preemptions = sum(s.preemptions for s in sched.seqs.values())
        assert (preemptions > 0) == (blocks == 20)
        if blocks == 20:  # re-admissions count only in the preempted_* counters (spec §12.1)
            assert mgr.metrics()["prefix_cache_preempted_requests"] == preemptions
    assert outs[0] == outs[1]
    assert outs[0]["r0"] == [token_at("r0", p) for p in range(120, 160)]


def test_prefill_chunks_end_at_the_replay_point_so_a_resend_hits() -> None:
    """An engine that writes states only at the end of a step still publishes ρ(P): the
    scheduler ends a chunk there (spec §9.4, §9.7)."""
    mgr = KVCacheManager(CacheConfig(num_blocks=256, **HYBRID))
    sched = Scheduler(mgr, FakeEngine(), SchedulerConfig(max_num_batched_tokens=8192))
    prompt = tokens(2048, 1)
    sched.add(Request("cold", prompt), max_tokens=1)
    steps = drain(sched)
    assert [s.num_prefill_tokens for s in steps] == [1792, 256]
    sched.add(Request("warm", prompt), max_tokens=1)
    drain(sched)
    assert sched.seqs["warm"].cached_tokens == 1792
    reconcile(sched)


def test_without_chunking_at_save_positions_the_state_is_missing() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=256, **HYBRID))
    cfg = SchedulerConfig(max_num_batched_tokens=8192, chunk_at_save_positions=False)
    sched = Scheduler(mgr, FakeEngine(), cfg)
    prompt = tokens(2048, 1)
    sched.add(Request("cold", prompt), max_tokens=1)
    drain(sched)
    sched.add(Request("warm", prompt), max_tokens=1)
    drain(sched)
    assert sched.seqs["warm"].cached_tokens == 0  # the replay state at 1792 was never written


def test_abort_frees_everything() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=512, **SMALL))
    sched = Scheduler(mgr, FakeEngine(), SchedulerConfig(max_num_batched_tokens=64))
    sched.add(Request("a", tokens(300, 1)), max_tokens=50)
    sched.add(Request("b", tokens(300, 2)), max_tokens=50)
    sched.step()
    sched.step()
    sched.abort("a")
    mgr.check_invariants()
    drain(sched)
    assert "a" not in mgr.requests and len(sched.seqs["b"].output) == 50
    reconcile(sched)


@pytest.mark.parametrize("mode", ["lookahead", "drop"])
def test_speculative_decoding(mode: str) -> None:
    groups = [GroupSpec(kind="full", block_size=16), GroupSpec(kind="recurrent", block_size=16)]
    if mode == "drop":
        groups.append(GroupSpec(kind="full", block_size=64, dcp_sharded=False, role="draft"))
    mgr = KVCacheManager(CacheConfig(num_blocks=1024, dcp_size=4, groups=groups, spec_mode=mode))
    sched = Scheduler(
        mgr,
        FakeEngine(accept_rate=0.6, seed=3),
        SchedulerConfig(num_spec_tokens=3, max_num_batched_tokens=512),
    )
    for i in range(4):
        sched.add(Request(f"r{i}", tokens(100, i)), max_tokens=40)
    steps = drain(sched)
    # drafts were accepted: fewer decode steps than generated tokens
    assert len(steps) < 4 * 40
    for s in sched.seqs.values():
        # exactly max_tokens, even when the last step accepted drafts past it
        assert s.output == [token_at(s.request_id, 100 + p) for p in range(40)]
        assert s.finish_reason == "length"
    reconcile(sched)


def test_burst_with_a_shared_prefix_computes_it_once_with_deferral() -> None:
    """32 requests with one system prompt arrive together: with deferral the prefix is computed
    once (spec §7.8 pending_hit), without it by every request admitted in the first step."""
    prefix = tokens(1024, 9)
    computed = {}
    for defer in (True, False):
        mgr = KVCacheManager(CacheConfig(num_blocks=4096, **SMALL))
        engine = FakeEngine()
        cfg = SchedulerConfig(max_num_batched_tokens=8192, defer_shared_prefix=defer)
        sched = Scheduler(mgr, engine, cfg)
        for i in range(32):
            sched.add(Request(f"r{i}", prefix + tokens(64, 100 + i)), max_tokens=1)
        steps = drain(sched)
        computed[defer] = sum(s.num_prefill_tokens for s in steps)
        reconcile(sched)
    assert computed[True] < computed[False]
    assert computed[True] <= 1024 + 32 * (64 + 64)  # the prefix once, suffixes (and re-copies)


def test_hybrid_burst_waits_for_the_attention_that_reveals_its_junction() -> None:
    """D15: on a hybrid, the first request plans no state at the end of a shared prefix (it
    cannot know where others diverge), so pending_hit stays 0 while it computes. Deferring on
    the pending attention bound (pending_bounds[2]) lets the second request see the junction,
    save the state there, and everyone after it reuse the prefix."""
    dep = preset("hybrid-dcp4")
    prefix = tokens(1024, 1)
    cached = {}
    for defer in (True, False):
        mgr = KVCacheManager(replace(dep.cache, enable_events=False))
        sched = Scheduler(mgr, FakeEngine(), replace(dep.sched, defer_shared_prefix=defer))
        for i in range(8):
            sched.add(Request(f"p{i}", prefix + tokens(1024, 100 + i)), max_tokens=2)
        drain(sched)
        cached[defer] = [sched.seqs[f"p{i}"].stats.cached_tokens for i in range(8)]
        reconcile(sched)
    assert cached[True] == [0, 0] + [1024] * 6
    # without deferral the whole first step (the token budget holds 4 prompts) starts cold
    assert cached[False][:4] == [0, 0, 0, 0] and sum(cached[False]) < sum(cached[True])


def test_deferred_requests_hold_seats_so_a_burst_is_not_rescanned() -> None:
    """A deferred request counts against max_num_seqs: one step looks up at most that many
    waiting requests, however long the queue (before, a burst looked up the whole queue)."""
    mgr = KVCacheManager(CacheConfig(num_blocks=4096, **SMALL))
    sched = Scheduler(mgr, FakeEngine(), SchedulerConfig(max_num_seqs=8))
    prefix = tokens(256, 9)
    for i in range(40):
        sched.add(Request(f"r{i}", prefix + tokens(16, 100 + i)), max_tokens=1)
    first = sched.step()
    assert first.admitted == ["r0"]
    assert first.deferred == [f"r{i}" for i in range(1, 8)]  # 1 running + 7 deferred = 8 seats
    assert [s.request_id for s in sched.waiting][:7] == first.deferred  # order kept (FCFS)
    steps = [first, *drain(sched)]
    assert all(len(s.admitted) + len(s.deferred) <= 8 for s in steps)
    assert all(sched.seqs[f"r{i}"].stats.cached_tokens == 256 for i in range(1, 40))
    reconcile(sched)


def test_stop_tokens_end_a_request_and_free_its_blocks() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=512, **SMALL))
    sched = Scheduler(mgr, FakeEngine(), SchedulerConfig(max_num_batched_tokens=128))
    stop = token_at("s", 100 + 5)  # the sixth generated token
    sched.add(Request("s", tokens(100, 1)), max_tokens=50, stop_token_ids={stop})
    sched.add(Request("t", tokens(100, 2)), max_tokens=20)
    drain(sched)
    s, t = sched.seqs["s"], sched.seqs["t"]
    first = next(i for i in range(50) if token_at("s", 100 + i) == stop)
    assert s.output == [token_at("s", 100 + i) for i in range(first + 1)]
    assert (s.finish_reason, t.finish_reason) == ("stop", "length") and len(t.output) == 20
    reconcile(sched)


def test_a_request_that_can_never_fit_is_rejected_not_spun_on() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=16, **SMALL))  # far too small for 2,000 tokens
    sched = Scheduler(mgr, FakeEngine(), SchedulerConfig(max_num_batched_tokens=4096))
    sched.add(Request("huge", tokens(2000, 1)), max_tokens=4)
    sched.add(Request("ok", tokens(30, 2)), max_tokens=4)
    steps = drain(sched, max_steps=50)
    assert steps[0].rejected == ["huge"] and sched.seqs["huge"].finish_reason == "too_large"
    assert sched.seqs["huge"].output == [] and len(sched.seqs["ok"].output) == 4
    assert "huge" not in mgr.requests
    reconcile(sched)


def test_abort_twice_or_after_finish_is_a_no_op() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=512, **SMALL))
    sched = Scheduler(mgr, FakeEngine(), SchedulerConfig())
    sched.add(Request("a", tokens(40, 1)), max_tokens=2)
    drain(sched)
    sched.abort("a")
    sched.abort("a")
    assert sched.seqs["a"].finish_reason == "length"
    reconcile(sched)


def test_a_request_whose_first_chunk_fits_but_not_its_whole_length_is_refused_up_front() -> None:
    """40 blocks of 16 tokens hold 624 tokens; a 1,000-token prompt's first 256-token chunk
    fits, so without the up-front check it is admitted, preempts itself when it outgrows the
    pool, and is admitted again, forever, while the request behind it starves."""
    mgr = KVCacheManager(CacheConfig(num_blocks=40, groups=[GroupSpec(kind="full", block_size=16)]))
    sched = Scheduler(mgr, FakeEngine(), SchedulerConfig(max_num_batched_tokens=256))
    sched.add(Request("big", tokens(1000, 1)), max_tokens=4)
    sched.add(Request("ok", tokens(30, 2)), max_tokens=4)
    steps = drain(sched, max_steps=50)
    assert steps[0].rejected == ["big"] and steps[0].preempted == []
    assert (
        sched.seqs["big"].finish_reason == "too_large" and sched.seqs["big"].cached_tokens is None
    )
    assert len(sched.seqs["ok"].output) == 4
    reconcile(sched)


@pytest.mark.parametrize("checked", [True, False])
def test_a_request_that_outgrows_the_pool_alone_is_refused(checked: bool) -> None:
    """The full group's 21 pages fit the 26 usable blocks, but with the sliding window's pages
    and the recurrent states the request does not. The up-front check (`peak_blocks`) refuses
    it before it runs. Without that check (a warm start can shift its chunks) it preempts
    itself with nothing else running and is refused then; before that backstop it was admitted
    again (166 times in 500 steps) while the request behind it never ran."""
    groups = [
        GroupSpec(kind="full", block_size=8),
        GroupSpec(kind="recurrent", block_size=8),
        GroupSpec(kind="sliding", block_size=8, window=32),
    ]
    mgr = KVCacheManager(CacheConfig(num_blocks=27, dcp_size=2, groups=groups))
    sched = Scheduler(mgr, FakeEngine(), SchedulerConfig(max_num_batched_tokens=64))
    big = sched.add(Request("big", tokens(313, 1)), max_tokens=10)
    assert big.too_large
    big.too_large = checked
    sched.add(Request("ok", tokens(30, 2)), max_tokens=4)
    steps = drain(sched, max_steps=100)
    refused = [st for st in steps if st.rejected]
    assert [st.rejected for st in refused] == [["big"]]
    assert refused[0].preempted == ([] if checked else ["big"])
    assert big.finish_reason == "too_large" and big.preemptions == (0 if checked else 1)
    assert len(sched.seqs["ok"].output) == 4
    assert mgr.metrics()["kv_usage"] == 0


def test_requests_that_fit_only_with_all_their_pages_run() -> None:
    """A request needing every usable block runs; one more token is refused."""
    cfg = CacheConfig(num_blocks=9, groups=[GroupSpec(kind="full", block_size=16)])
    sched = Scheduler(KVCacheManager(cfg), FakeEngine(), SchedulerConfig())
    # 8 usable blocks hold 128 tokens: the prompt and the tokens the last step computes
    sched.add(Request("fits", tokens(120, 1)), max_tokens=9)
    sched.add(Request("one-more", tokens(121, 2)), max_tokens=9)
    drain(sched, max_steps=50)
    assert sched.seqs["fits"].finish_reason == "length"
    assert sched.seqs["one-more"].finish_reason == "too_large"


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_spec_tokens": 3, "max_num_batched_tokens": 3}, r"1 \+ num_spec_tokens = 4"),
        ({"max_num_seqs": "8"}, "max_num_seqs must be an int"),
        ({"max_num_batched_tokens": True}, "max_num_batched_tokens must be an int"),
        ({"max_num_seqs": 2**63}, r"max_num_seqs must be in \[1, 2\*\*63\)"),
        ({"defer_shared_prefix": "false"}, "defer_shared_prefix must be true or false"),
    ],
)
def test_scheduler_config_rejects_what_could_never_run(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        SchedulerConfig(**kwargs)


def test_a_step_reports_its_peak_block_usage() -> None:
    """Counted after the step's allocations: a request that finishes within the step still
    shows in it (its blocks are released only afterwards)."""
    cfg = CacheConfig(num_blocks=64, groups=[GroupSpec(kind="full", block_size=16)])
    mgr = KVCacheManager(cfg)
    sched = Scheduler(mgr, FakeEngine(), SchedulerConfig())
    sched.add(Request("a", tokens(100, 1)), max_tokens=1)
    st = sched.step()
    assert st.finished == ["a"] and st.num_used_blocks == 7  # ⌈100 / 16⌉ pages
    assert mgr.num_free_blocks == 63  # released after the step
