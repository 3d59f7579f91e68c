"""Deferral, withdrawal and overlapped steps (spec §10.6), step by step."""

from __future__ import annotations

from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request

GEO_H = CacheConfig(
    num_blocks=64,
    dcp_size=4,
    groups=[GroupSpec(kind="full", block_size=16), GroupSpec(kind="recurrent", block_size=16)],
)


def checked(m: KVCacheManager) -> KVCacheManager:
    m.check_invariants()
    return m


def test_finish_with_a_sealed_and_an_open_plan_withdraws_the_open_one_now() -> None:
    m = KVCacheManager(GEO_H)
    m.add_request(Request("a", list(range(100))))
    m.allocate("a", 60, lookup=m.lookup("a"))
    s1 = m.seal_step()
    m.allocate("a", 40)  # overlapped growth while s1 is in flight: [60, 100)
    checked(m)
    m.finish("a")  # deferred to s1; the open plan is withdrawn at once
    checked(m)
    s2 = m.seal_step()
    assert s2.requests == []  # the engine never sees the withdrawn plan
    m.commit(s1.step_id, {})  # the deferred request's outcome may be omitted
    checked(m)
    assert "a" not in m.requests
    assert m.num_free_blocks == 63
    assert m.export_entries() == []  # nothing of an uncommitted step is published


def test_overlapped_prefill_then_decode_uses_n_hat() -> None:
    m = KVCacheManager(GEO_H)
    m.add_request(Request("a", list(range(100))))
    m.allocate("a", 100, lookup=m.lookup("a"))
    s1 = m.seal_step()
    plan = m.allocate("a", 1)  # decode of token 100 while s1 (which samples it) is in flight
    assert plan is not None and (plan.start, plan.end) == (100, 101)
    s2 = m.seal_step()
    checked(m)
    m.commit(s1.step_id, {"a": (100, [7])})
    m.commit(s2.step_id, {"a": (101, [8])})
    checked(m)
    assert m.requests["a"].tokens[-2:].tolist() == [7, 8]
    stats = m.finish("a")
    assert stats.cached_tokens == 0
    checked(m)


def test_preempt_then_finish_while_deferred_becomes_a_finish() -> None:
    m = KVCacheManager(GEO_H)
    m.add_request(Request("a", list(range(100))))
    m.allocate("a", 100, lookup=m.lookup("a"))
    s1 = m.seal_step()
    m.preempt("a")
    epoch = m.epoch
    m.preempt("a")  # repeated: changes nothing
    assert m.epoch == epoch
    m.finish("a")  # turns the deferred preemption into a finish
    epoch = m.epoch
    m.finish("a")  # repeated: changes nothing
    assert m.epoch == epoch
    m.discard(s1.step_id)
    checked(m)
    assert "a" not in m.requests and m.request_stats("a").admissions == 1


def test_pending_hit_sees_plans_sealed_since_the_last_lookup() -> None:
    """The pending-key union is kept between lookups (core/pending.py); a plan allocated
    without a lookup and then sealed must still count for a lookup between seal and commit."""
    m = KVCacheManager(
        CacheConfig(num_blocks=64, hash_unit=16, groups=[GroupSpec(kind="full", block_size=16)])
    )
    prompt = list(range(64))
    for rid, toks in (("a", prompt), ("b", prompt), ("c", list(range(100, 164)))):
        m.add_request(Request(rid, toks))
    m.allocate("c", 64, lookup=m.lookup("c"))
    s1 = m.seal_step()
    m.commit(s1.step_id, {"c": (64, [7])})
    m.allocate("c", 1)  # growth: a plan, no lookup
    assert m.lookup("a").pending_hit == 0  # the union is built here, with c's plan only
    m.allocate("a", 64, lookup=m.lookup("a"))  # a computes the shared prompt ...
    m.seal_step()  # ... and is sealed before anyone looks up again
    res = m.lookup("b")
    assert (res.hit, res.pending_hit) == (0, 48)  # a's publishable boundaries (below P - 1)
    checked(m)
