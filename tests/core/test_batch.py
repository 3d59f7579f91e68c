"""The batched operations: `allocate_many` and `commit_batch` (their equivalence with the
per-request calls is checked on random histories by the property harness)."""

from __future__ import annotations

import pytest

from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Outcome, Request

CFG = CacheConfig(num_blocks=16, groups=[GroupSpec(kind="full", block_size=4)])


def running(mgr: KVCacheManager, *rids: str) -> None:
    for i, rid in enumerate(rids):
        mgr.add_request(Request(rid, [i, 1, 2, 3, 4, 5]))
        res = mgr.lookup(rid)
        assert mgr.allocate(rid, 6 - res.hit, lookup=res) is not None
    step = mgr.seal_step()
    mgr.commit_batch(step.step_id, [Outcome(6, [9]) for _ in step.requests])


def test_allocate_many_grows_in_order_and_reports_what_did_not_fit() -> None:
    mgr = KVCacheManager(CFG)
    running(mgr, "a", "b")
    free = mgr.num_free_blocks
    plans = mgr.allocate_many(["a", "b"], [1, 4 * free + 8])  # b needs more than the pool
    assert plans[0] is not None and plans[0].start == 6 and plans[0].num_new_tokens == 1
    assert plans[1] is None
    mgr.check_invariants()
    step = mgr.seal_step()
    assert [p.request_id for p in step.requests] == ["a"]


def test_allocate_many_checks_its_arguments_like_allocate() -> None:
    mgr = KVCacheManager(CFG)
    running(mgr, "a")
    with pytest.raises(ValueError, match="2 request ids but 1 token counts"):
        mgr.allocate_many(["a", "a"], [1])
    with pytest.raises(ValueError, match="unknown request 'zz'"):
        mgr.allocate_many(["zz"])
    mgr.add_request(Request("w", [7, 7, 7, 7, 7]))
    with pytest.raises(ValueError, match="needs its LookupResult"):
        mgr.allocate_many(["w"])  # an admission needs a lookup: the per-request rule applies


def test_commit_batch_takes_outcomes_in_plan_order() -> None:
    mgr = KVCacheManager(CFG)
    running(mgr, "a", "b")
    assert mgr.allocate_many(["a", "b"]) != [None, None]
    step = mgr.seal_step()
    with pytest.raises(ValueError, match="sequence in plan order"):
        mgr.commit_batch(step.step_id, {"a": (7, [1])})  # type: ignore[arg-type]  # wrong on purpose
    with pytest.raises(ValueError, match="1 outcomes for a step of 2 plans"):
        mgr.commit_batch(step.step_id, [(7, [1])])
    mgr.finish("b")  # deferred: its outcome slot is ignored
    mgr.commit_batch(step.step_id, [(7, [1]), None])
    mgr.check_invariants()
    assert "b" not in mgr.requests and mgr.requests["a"].committed == 7


@pytest.mark.parametrize("page", [4, 8])
@pytest.mark.parametrize("lookahead", [0, 1, 2, 4])
def test_decode_commits_publish_every_boundary_they_complete(page: int, lookahead: int) -> None:
    """Each commit makes findable every unit boundary in (0, min(T, units·u)], where the chain
    holds the units with k·u + L ≤ N (spec §10.3). In lookahead mode a one-token decode step
    inside one unit still completes a unit of the chain (the boundary L tokens back): its
    commit must publish it then, not one step later."""
    spec = {"spec_mode": "lookahead", "lookahead_tokens": lookahead} if lookahead else {}
    cfg = CacheConfig(
        num_blocks=64, groups=[GroupSpec(kind="full", block_size=page)], hash_unit=4, **spec
    )
    mgr = KVCacheManager(cfg)
    mgr.add_request(Request("a", [3, 1, 4, 1, 5, 9]))
    res = mgr.lookup("a")
    assert mgr.allocate("a", 6, lookup=res) is not None
    step = mgr.seal_step()
    mgr.commit_batch(step.step_id, [(6, [2])])
    num_tokens, t = 7, 6
    for token in range(30):
        assert mgr.allocate_many(["a"]) != [None]
        step = mgr.seal_step()
        mgr.commit_batch(step.step_id, [(t + 1, [token % 7])])
        num_tokens, t = num_tokens + 1, t + 1
        mgr.check_invariants()
        units = (num_tokens - lookahead) // 4
        want = set(range(4, min(t, units * 4) + 1, 4))
        assert {row[1] for row in mgr.export_entries()} == want, (t, num_tokens)


def test_a_decode_plan_that_crosses_a_boundary_counts_as_pending() -> None:
    """A batched decode plan whose commit would publish a boundary (7 → 8 crosses 8 with u = 4)
    is no quiet plan: a lookup made while it is open reports that key in pending_hit (§7.8),
    while one inside a unit (8 → 9) adds nothing."""
    mgr = KVCacheManager(CFG)
    prompt = [1, 2, 3, 4, 5, 6]
    mgr.add_request(Request("a", prompt))
    res = mgr.lookup("a")
    assert mgr.allocate("a", 6, lookup=res) is not None
    step = mgr.seal_step()
    mgr.commit_batch(step.step_id, [(6, [7])])
    mgr.add_request(Request("b", [*prompt, 7, 8, 9, 9]))
    for position, token, want in ((6, 8, (4, 4)), (7, 9, (4, 8)), (8, 5, (8, 8))):
        assert [p.start for p in mgr.allocate_many(["a"]) if p] == [position]
        res = mgr.lookup("b")
        assert (res.hit, res.pending_hit) == want, position
        step = mgr.seal_step()
        mgr.commit_batch(step.step_id, [(position + 1, [token])])
        mgr.check_invariants()
