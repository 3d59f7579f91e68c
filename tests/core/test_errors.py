"""Bad input gets a clear error that says what was wrong, and changes nothing (spec §3)."""

from __future__ import annotations

from array import array

import pytest

from harness import snapshot
from kvreuse import (
    CacheConfig,
    GroupSpec,
    KVCacheManager,
    MultiModalItem,
    Request,
    StaleLookupError,
    UnknownRequestError,
)

GEO_H = CacheConfig(
    num_blocks=64,
    dcp_size=4,
    groups=[GroupSpec(kind="full", block_size=16), GroupSpec(kind="recurrent", block_size=16)],
)


@pytest.fixture
def mgr() -> KVCacheManager:
    return KVCacheManager(GEO_H)


@pytest.mark.parametrize(
    ("request_", "exc", "fragment"),
    [
        (Request("", [1, 2]), ValueError, "non-empty str"),
        (Request("a", []), ValueError, "prompt is empty"),
        (
            Request("a", [1, -1]),
            ValueError,
            r"token 1 is -1; token ids must be ints in \[0, 2\*\*32\)",
        ),
        (Request("a", [1, 2**32]), ValueError, "token 1 is 4294967296"),
        (Request("a", [1, True]), ValueError, "token 1 is True"),
        (Request("a", [1, 2.0]), ValueError, "token 1 is 2.0"),
        (Request("a", array("i", [1, -1])), ValueError, "token 1 is -1"),  # signed: checked
        (Request("a", array("Q", [1, 2**32])), ValueError, "token 1 is 4294967296"),
        (Request("a", [1], cache_salt=b"x"), TypeError, "cache_salt must be str"),
        (Request("a", [1], lora=("x", b"p")), TypeError, "lora must be"),
        (Request("a", [1], mm_items=[("img", 0, 1)]), TypeError, "MultiModalItem"),
    ],
)
def test_bad_requests(mgr: KVCacheManager, request_: Request, exc: type, fragment: str) -> None:
    before = snapshot(mgr)
    with pytest.raises(exc, match=fragment):
        mgr.add_request(request_)
    assert snapshot(mgr) == before


@pytest.mark.parametrize("code", ["B", "H", "I"])
def test_unsigned_array_prompts_are_valid_by_type(mgr: KVCacheManager, code: str) -> None:
    """D14: an unsigned array of at most 4-byte elements skips the per-element check and
    hashes exactly as the same list does; the request keeps its own 4-byte copy."""
    tokens = [(7 * i) % 251 for i in range(100)]
    mgr.add_request(Request("arr", array(code, tokens)))
    mgr.add_request(Request("lst", tokens))
    a, b = mgr.requests["arr"], mgr.requests["lst"]
    assert a.tokens.tolist() == tokens == b.tokens.tolist()
    assert a.tokens.typecode == b.tokens.typecode == "I"
    assert a.chain.hashes == b.chain.hashes


def test_bad_multimodal_item() -> None:
    with pytest.raises(ValueError, match="offset must be an int ≥ 0"):
        MultiModalItem("img", -1, 4)
    with pytest.raises(TypeError, match="identifier must be str or bytes"):
        MultiModalItem(7, 0, 4)  # type: ignore[arg-type]


def test_duplicate_and_unknown_requests(mgr: KVCacheManager) -> None:
    mgr.add_request(Request("a", list(range(40))))
    with pytest.raises(ValueError, match="already registered"):
        mgr.add_request(Request("a", [1]))
    for call in (
        lambda: mgr.lookup("zz"),
        lambda: mgr.finish("zz"),
        lambda: mgr.preempt("zz"),
        lambda: mgr.allocate("zz", 1),
        lambda: mgr.request_stats("zz"),
    ):
        with pytest.raises(UnknownRequestError, match="unknown"):
            call()
    mgr.finish("a")
    with pytest.raises(UnknownRequestError, match="it has finished"):
        mgr.lookup("a")
    assert mgr.request_stats("a").reason == "not_admitted"
    assert issubclass(UnknownRequestError, KeyError) and issubclass(UnknownRequestError, ValueError)


@pytest.mark.parametrize(
    ("num_new", "extra", "fragment"),
    [
        (0, 0, "num_new_tokens ≥ 1"),
        (-3, 0, "num_new_tokens ≥ 1"),
        (5, -1, "num_extra_slots ≥ 0"),
        (41, 0, "exceeds the request's 40 tokens"),
        (2.5, 0, "num_new_tokens must be an int"),
    ],
)
def test_bad_admission_counts(mgr: KVCacheManager, num_new, extra, fragment: str) -> None:
    mgr.add_request(Request("a", list(range(40))))
    res = mgr.lookup("a")
    before = snapshot(mgr)
    with pytest.raises(ValueError, match=fragment):
        mgr.allocate("a", num_new, lookup=res, num_extra_slots=extra)
    assert snapshot(mgr) == before


def test_admission_rules(mgr: KVCacheManager) -> None:
    mgr.add_request(Request("a", list(range(40))))
    mgr.add_request(Request("b", list(range(40))))
    with pytest.raises(ValueError, match="needs its LookupResult"):
        mgr.allocate("a", 40)
    res_b = mgr.lookup("b")
    res = mgr.lookup("a")
    mgr.allocate("a", 20, lookup=res)
    with pytest.raises(StaleLookupError, match="call lookup"):
        mgr.allocate("b", 40, lookup=res_b)
    with pytest.raises(ValueError, match="already has a plan in the open step"):
        mgr.allocate("a", 5)
    with pytest.raises(ValueError, match="only waiting requests look up"):
        mgr.lookup("a")
    step = mgr.seal_step()
    with pytest.raises(ValueError, match="growth takes no lookup"):
        mgr.allocate("a", 5, lookup=res)
    mgr.commit(step.step_id, {"a": (20, [])})
    with pytest.raises(ValueError, match="passes N=40"):
        mgr.allocate("a", 21)
    with pytest.raises(ValueError, match="is not running"):
        mgr.preempt("b")


def test_commit_validation(mgr: KVCacheManager) -> None:
    mgr.add_request(Request("a", list(range(40))))
    mgr.allocate("a", 40, lookup=mgr.lookup("a"))
    step = mgr.seal_step()
    before = snapshot(mgr)
    cases = [
        ({}, "no outcome for"),
        ({"a": (40, [1]), "b": (1, [])}, "not in this step"),
        ({"a": (41, [1])}, "outside its step"),
        ({"a": (40, [])}, "without a new token"),
        ({"a": (39, [1])}, r"must lie in \[40, 40\]"),
        ({"a": (40, [-1])}, "token ids must be ints"),
        ({"a": (40, [1], [999])}, "not saves of this step"),
        ({"a": 40}, "must be"),
    ]
    for outcomes, fragment in cases:
        with pytest.raises(ValueError, match=fragment):
            mgr.commit(step.step_id, outcomes)
        assert snapshot(mgr) == before
    mgr.commit(step.step_id, {"a": (40, [1])})
    with pytest.raises(ValueError, match="already committed"):
        mgr.commit(step.step_id, {"a": (40, [1])})
    with pytest.raises(ValueError, match="unknown step"):
        mgr.commit(999, {})


def test_steps_settle_in_order(mgr: KVCacheManager) -> None:
    mgr.add_request(Request("a", list(range(40))))
    mgr.add_request(Request("b", list(range(100, 140))))
    mgr.allocate("a", 20, lookup=mgr.lookup("a"))
    s1 = mgr.seal_step()
    mgr.allocate("b", 40, lookup=mgr.lookup("b"))
    s2 = mgr.seal_step()
    before = snapshot(mgr)
    with pytest.raises(ValueError, match=f"out of order; settle step {s1.step_id} first"):
        mgr.commit(s2.step_id, {"b": (40, [1])})
    with pytest.raises(ValueError, match="out of order"):
        mgr.discard(s2.step_id)
    assert snapshot(mgr) == before
    empty = mgr.seal_step()
    mgr.commit(empty.step_id, {})  # an empty step needs no commit; committing it does nothing
    assert snapshot(mgr) == before
    mgr.commit(s1.step_id, {"a": (20, [])})
    mgr.commit(s2.step_id, {"b": (40, [1])})
    mgr.check_invariants()


@pytest.mark.parametrize("capacity", [0, 2])
def test_finished_statistics_are_bounded(capacity: int) -> None:
    from dataclasses import replace

    m = KVCacheManager(replace(GEO_H, finished_stats_capacity=capacity))
    for i in range(4):
        m.add_request(Request(f"r{i}", list(range(40))))
        res = m.lookup(f"r{i}")
        m.allocate(f"r{i}", 40 - res.hit, lookup=res)
        m.commit(m.seal_step().step_id, {f"r{i}": (40, [1])})
        stats = m.finish(f"r{i}")  # finish always returns the statistics
        assert stats.request_id == f"r{i}" and stats.admissions == 1
    kept = [i for i in range(4) if i >= 4 - capacity]
    for i in range(4):
        if i in kept:
            assert m.request_stats(f"r{i}").cached_tokens == (0 if i == 0 else 32)
        else:
            with pytest.raises(KeyError):
                m.request_stats(f"r{i}")
