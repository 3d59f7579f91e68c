"""`add_request` validates every extra key completely: a value that could not be hashed later
(inside `commit`, once its first unit completes) is rejected at once, naming the field, and the
manager is left exactly as it was (a call that raises changes nothing)."""

from __future__ import annotations

import pytest

from harness import snapshot
from kvreuse import CacheConfig, GroupSpec, KVCacheManager, MultiModalItem, Request

GEO = CacheConfig(
    num_blocks=64,
    dcp_size=4,
    groups=[GroupSpec(kind="full", block_size=16), GroupSpec(kind="recurrent", block_size=16)],
)


def run_to_end(m: KVCacheManager, req: Request) -> None:
    """Register, admit, compute and commit the whole prompt (its first unit is hashed in
    commit when the prompt is shorter than a unit at registration)."""
    m.add_request(req)
    rid, tokens = req.request_id, list(req.prompt_token_ids)
    res = m.lookup(rid)
    assert m.allocate(rid, len(tokens) - res.hit, lookup=res) is not None
    step = m.seal_step()
    m.commit(step.step_id, {rid: (len(tokens), [5])})
    m.finish(rid)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"cache_salt": "\ud800"}, "cache_salt"),
        ({"cache_salt": "tenant-\udfff-a"}, "cache_salt"),
        ({"lora": ("adapter\ud83d", "/p")}, "lora name"),
        ({"lora": ("adapter", "/p\udc00")}, "lora path"),
        ({"mm_items": [MultiModalItem("img-\ud800", 0, 2)]}, "multimodal identifier"),
        ({"mm_items": [MultiModalItem("img", 2**63, 2)]}, "multimodal offset"),
        ({"mm_items": [MultiModalItem(b"img", 2**64, 1)]}, "multimodal offset and length"),
    ],
)
def test_an_unhashable_extra_key_is_rejected_by_add_request(
    extra: dict[str, object], field: str
) -> None:
    m = KVCacheManager(GEO)
    before = snapshot(m)
    # three tokens: no unit is complete yet, so nothing would be hashed before the commit
    with pytest.raises(ValueError, match=f"request 'bad': {field}"):
        m.add_request(Request("bad", [1, 2, 3], **extra))  # type: ignore[arg-type]
    assert snapshot(m) == before
    m.check_invariants()
    # the manager goes on: a good request runs to the end, and the id is free again
    run_to_end(m, Request("good", list(range(40))))
    run_to_end(m, Request("bad", [1, 2, 3], cache_salt="tenant-a"))
    m.check_invariants()


def test_a_long_prompt_with_a_bad_salt_names_the_field_not_the_codec() -> None:
    m = KVCacheManager(GEO)
    before = snapshot(m)
    with pytest.raises(ValueError) as info:
        m.add_request(Request("r", list(range(100)), cache_salt="\ud800"))
    assert not isinstance(info.value, UnicodeError)
    assert "cache_salt" in str(info.value) and "surrogate" in str(info.value)
    assert snapshot(m) == before


@pytest.mark.parametrize(
    "extra",
    [
        {"cache_salt": "tenant-é-日本"},
        {"lora": ("ädapter", "/päth")},
        {"mm_items": [MultiModalItem("imgé", 0, 20)]},
    ],
)
def test_valid_unicode_extra_keys_are_accepted_and_hash(extra: dict[str, object]) -> None:
    m = KVCacheManager(GEO)
    run_to_end(m, Request("ok", list(range(40)), **extra))  # type: ignore[arg-type]
    m.check_invariants()
