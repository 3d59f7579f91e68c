"""The headline: on an 8,192-token page (local 2,048 × DCP 4) with hash unit 256, an identical
resend of a 2,048-token prompt reuses 1,792 tokens and of a 2,049-token prompt 2,048 — for the
hybrid with a 256-token recurrent group and for pure attention alike (the server that reused 0
of 2,048 searched only below the cap, while the only entry sat at 2,048)."""

from __future__ import annotations

import random

import pytest

from kvreuse import CacheConfig, GroupSpec, KVCacheManager, Request

HYBRID = [GroupSpec(kind="full", block_size=2048), GroupSpec(kind="recurrent", block_size=256)]
PURE = [GroupSpec(kind="full", block_size=2048)]


def run(mgr: KVCacheManager, rid: str, tokens: list[int]) -> tuple[int, str, int]:
    mgr.add_request(Request(rid, tokens))
    res = mgr.lookup(rid)
    plan = mgr.allocate(rid, len(tokens) - res.hit, lookup=res)
    assert plan is not None
    step = mgr.seal_step()
    mgr.commit(step.step_id, {rid: (len(tokens), [1])})
    stats = mgr.finish(rid)
    mgr.check_invariants()
    return stats.cached_tokens, stats.reason, len(step.copies)


@pytest.mark.parametrize("groups", [HYBRID, PURE], ids=["hybrid", "pure-attention"])
@pytest.mark.parametrize(
    ("prompt", "reused"),
    [(2048, 1792), (2049, 2048), (8192, 7936), (8193, 8192), (255, 0), (257, 256)],
)
def test_identical_resend(groups: list[GroupSpec], prompt: int, reused: int) -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=64, dcp_size=4, hash_unit=256, groups=groups))
    assert mgr.config.geometry.groups[0].page_size == 8192
    tokens = [random.Random(prompt).randrange(32000) for _ in range(prompt)]
    assert run(mgr, "cold", tokens)[0] == 0
    hit, reason, copies = run(mgr, "warm", tokens)
    assert hit == reused == (prompt - 1) // 256 * 256
    assert reason == ("cap_reached" if reused else "below_unit")
    # a hit inside the 8,192-token page is copied (copy-on-write); a recurrent hit always is
    expected_copies = (1 if reused % 8192 else 0) + (1 if reused and groups is HYBRID else 0)
    assert copies == expected_copies


@pytest.mark.parametrize("groups", [HYBRID, PURE], ids=["hybrid", "pure-attention"])
def test_only_entry_above_the_cap_still_serves(groups: list[GroupSpec]) -> None:
    """Edge case 4: the entries below the cap are gone; the one at 2,048 proves 1,792."""
    mgr = KVCacheManager(CacheConfig(num_blocks=64, dcp_size=4, hash_unit=256, groups=groups))
    tokens = [random.Random(7).randrange(32000) for _ in range(2048)]
    run(mgr, "q", tokens[:1792])  # Q publishes 256 … 1792 (and states at 1536, 1792)
    run(mgr, "a", tokens)  # A copies Q's page, adds only 2048 to its own block
    q_block = next(b for g, bd, _, _, b in mgr.export_entries() if g == 0 and bd == 256)
    mgr.evict(q_block)
    remaining = sorted(bd for g, bd, *_ in mgr.export_entries() if g == 0)
    assert remaining == [2048]
    assert run(mgr, "resend", tokens)[:2] == (1792, "cap_reached")
