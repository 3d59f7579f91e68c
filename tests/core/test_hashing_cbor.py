"""hash_algo "sha256_cbor": vLLM's own block hashes, without vLLM.

The pinned values come from vLLM 0.33.0 itself: tests/events/vllm_hash_driver.py run with
`.venv-vllm-anchor/bin/python` (benchmarks/vllm/setup_venv.sh) on the traffic of
`test_pinned_vllm_hashes`, block size 4, once with PYTHONHASHSEED=4242 and once unset; the hex
strings are what vLLM's `request.block_hashes`, `NONE_HASH` and KV events printed.
tests/events/test_vllm_hashes.py checks the same against a live vLLM where its venv exists.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from depth import scaled
from kvreuse.core import CacheConfig, ConfigError, GroupSpec, KVCacheManager, MultiModalItem, native
from kvreuse.core.hashing.cbor import block_extra_keys, block_hash, cbor, none_hash
from kvreuse.core.hashing.hasher import Hasher
from kvreuse.events.wire import hash64

VLLM_NONE_HASH_4242 = "b64678896fa8f06dcbc445f266ae70b818b56af9181623bfd85f4927d77bb3b1"
VLLM_NONE_HASH_UNSET = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
VLLM_PLAIN = [  # tokens 1…10, block 4, PYTHONHASHSEED=4242
    "8fe3fdca8de53e98398d0c98619e8d20f7876544562abc72313f5b64c0bbcffe",
    "442c9191740ef4a300afd9d92a6f227260b91982896ff81bc64bff90233e9e65",
]
VLLM_EXTRAS = [  # tokens 1…12, LoRA ("ad1", "/p/ad1"), salt "s1", image "img0" at [5, 7)
    "9e13693bdfdd9ba78edca941da2914fc753181aa9223e93197d72618112c7b99",
    "6fcb08ea75b9b179f838e249765e7c60fe99d656e72d0dfd3df6c47164928343",
    "9b5d010093261af31ec5d1127890607e733bc8604c5558e520408dae530e3359",
]
VLLM_BIG_TOKEN = [  # 1, 2, 3, 4, 5, 6, 70000, 8, 9: a token id past 2**16
    "8fe3fdca8de53e98398d0c98619e8d20f7876544562abc72313f5b64c0bbcffe",
    "e2f76ec4c54821f37b99408226d54942f13f8fe2745fe543ee6e698310584e6e",
]
# the ints vLLM's KV events carried for VLLM_PLAIN and VLLM_EXTRAS
VLLM_EVENT_INTS = [3548655519679631358, 14288795237294710373]
VLLM_EVENT_INTS_EXTRAS = [10941255704529107865, 4464972071882097475, 2324013187580441433]


def test_pinned_vllm_hashes() -> None:
    h = Hasher("sha256_cbor", 4, 0, "4242")
    assert h.root.hex() == VLLM_NONE_HASH_4242
    assert Hasher("sha256_cbor", 4).root.hex() == VLLM_NONE_HASH_UNSET
    assert [x.hex() for x in h.hash_units(list(range(1, 11)))[1:]] == VLLM_PLAIN
    extras = h.hash_units(
        list(range(1, 13)),
        lora=("ad1", "/p/ad1"),
        cache_salt="s1",
        mm_items=[MultiModalItem("img0", 5, 2)],
    )
    assert [x.hex() for x in extras[1:]] == VLLM_EXTRAS
    assert [x.hex() for x in h.hash_units([1, 2, 3, 4, 5, 6, 70000, 8, 9])[1:]] == VLLM_BIG_TOKEN


def test_wire_int_is_vllm_event_int() -> None:
    """vLLM sends `int.from_bytes(hash, "big") & (2**64 - 1)`: kvreuse's hash64 of the digest."""
    assert [hash64(bytes.fromhex(x)) for x in VLLM_PLAIN] == VLLM_EVENT_INTS
    assert [hash64(bytes.fromhex(x)) for x in VLLM_EXTRAS] == VLLM_EVENT_INTS_EXTRAS


def test_extra_keys_are_vllms_tagged_keys() -> None:
    lora, items = ("ad1", "/p/ad1"), [MultiModalItem("img0", 5, 2)]
    assert block_extra_keys(1, 4, lora, items, "s1") == (
        ("lora", "ad1", "/p/ad1"),
        ("cache_salt", "s1"),
    )
    assert block_extra_keys(2, 4, lora, items, "s1") == (
        ("lora", "ad1", "/p/ad1"),
        ("mm", "img0", 1),
    )
    assert block_extra_keys(3, 4, None, items, "") is None  # "" is no salt


def test_chain_matches_the_definition_incrementally() -> None:
    """The chain, fed a token at a time, equals `block_hash` link by link (the reference)."""
    rng = random.Random(5)
    h = Hasher("sha256_cbor", 16, 0, "7")
    tokens = [rng.randrange(200_000) for _ in range(200)]
    items = [MultiModalItem("a", 10, 30), MultiModalItem("b", 40, 8)]
    c = h.chain(lora=("x", "p"), mm_items=items, cache_salt="salt")
    for i in range(len(tokens) + 1):
        c.extend(tokens[:i])
    parent = h.root
    for k in range(1, len(tokens) // 16 + 1):
        extra = block_extra_keys(k, 16, ("x", "p"), items, "salt")
        parent = block_hash(parent, tokens[(k - 1) * 16 : k * 16], extra)
        assert (
            c.hashes[k]
            == parent
            == h.unit_hash(c.hashes[k - 1], tokens[(k - 1) * 16 : k * 16], (), extra)
        )


def test_cbor_matches_cbor2() -> None:
    cbor2 = pytest.importorskip("cbor2")
    samples = [
        None,
        0,
        23,
        24,
        255,
        256,
        65535,
        65536,
        2**32,
        2**64 - 1,
        -1,
        -25,
        "",
        "héllo",
        b"",
        b"\x00" * 32,
        (),
        (1, (2, "x"), None),
        ("mm", "id", 3),
        tuple(range(300)),
    ]
    for obj in samples:
        assert cbor(obj) == cbor2.dumps(obj, canonical=True), obj
    assert none_hash("4242").hex() == VLLM_NONE_HASH_4242


def test_no_native_kernel_both_paths_agree() -> None:
    """The C kernel splices kvreuse's encoding, so sha256_cbor never takes it: under the native
    core and KVREUSE_PURE=1 alike, the chain is this module's Python (pinned values above)."""
    assert native.chain_kernel("sha256_cbor") is None
    assert Hasher("sha256_cbor", 4).template.kernel is None
    assert [
        x.hex() for x in Hasher("sha256_cbor", 4, 0, "4242").hash_units(list(range(1, 11)))[1:]
    ] == VLLM_PLAIN


def test_manager_runs_the_mode() -> None:
    cfg = CacheConfig(
        num_blocks=64, hash_algo="sha256_cbor", hash_seed="4242", groups=[GroupSpec("full", 4)]
    )
    mgr = KVCacheManager(cfg)
    assert mgr.hasher.hash_units(list(range(1, 11)))[1].hex() == VLLM_PLAIN[0]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        (dict(groups=[GroupSpec("full", 16), GroupSpec("recurrent", 16)]), "one full-attention"),
        (dict(groups=[GroupSpec("sliding", 16, window=64)]), "one full-attention"),
        (dict(groups=[GroupSpec("full", 16)], dcp_size=2), "without DCP"),
        (dict(groups=[GroupSpec("full", 16)], hash_unit=8), "hash_unit = block_size"),
        (dict(groups=[GroupSpec("full", 16)], spec_mode="lookahead"), "spec_mode 'none'"),
        (dict(groups=[GroupSpec("full", 16)], hash_seed=b"42"), "hash_seed as a str"),
    ],
)
def test_geometries_that_cannot_use_it_refuse_in_one_line(kwargs: dict, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        CacheConfig(num_blocks=64, hash_algo="sha256_cbor", **kwargs)
    assert says in str(e.value) and "\n" not in str(e.value)


@settings(max_examples=scaled(100), deadline=None)
@given(
    tokens=st.lists(st.integers(0, 300_000), max_size=80),
    u=st.integers(1, 9),
    cuts=st.lists(st.integers(0, 80), max_size=5),
    lora=st.none() | st.just(("fr", "/ad/v1")),
    spans=st.lists(st.tuples(st.integers(0, 70), st.integers(1, 20)), max_size=3),
    salt=st.sampled_from([None, "", "t1"]),
)
def test_incremental_equals_one_shot_and_the_definition(
    tokens: list[int], u: int, cuts: list[int], lora, spans, salt
) -> None:
    # non-overlapping placeholders in order of offset, as vLLM's multimodal features are
    items, end = [], 0
    for i, (gap, length) in enumerate(spans):
        items.append(MultiModalItem(f"img{i}", end + gap, length))
        end += gap + length
    h = Hasher("sha256_cbor", u, 0, "99")
    chain = h.chain(lora=lora, mm_items=items, cache_salt=salt)
    for cut in [*sorted(cuts), len(tokens)]:
        assert chain.extend(tokens[:cut]) == chain.num_units == min(cut, len(tokens)) // u
    parent, want = h.root, [h.root]
    for k in range(1, len(tokens) // u + 1):
        extra = block_extra_keys(k, u, lora, items, salt)
        parent = block_hash(parent, tokens[(k - 1) * u : k * u], extra)
        want.append(parent)
    assert chain.hashes == want == h.hash_units(tokens, lora=lora, mm_items=items, cache_salt=salt)


def test_a_geometry_file_selects_it_as_kvreuse_serve_reads_it() -> None:
    """`kvreuse serve --geometry FILE` builds its config with `load_geometry`."""
    from kvreuse.deployment import load_geometry

    text = '[cache]\nnum_blocks = 64\nhash_algo = "sha256_cbor"\nhash_seed = "4242"\n'
    dep = load_geometry(text + '[[groups]]\nkind = "full"\nblock_size = 4\n')
    mgr = KVCacheManager(dep.cache)
    assert mgr.hasher.root.hex() == VLLM_NONE_HASH_4242 and dep.cache.geometry.vllm_hashes
    with pytest.raises(ConfigError, match="one full-attention"):
        load_geometry(
            text + '[[groups]]\nkind = "full"\nblock_size = 4\n'
            '[[groups]]\nkind = "recurrent"\nblock_size = 4\n'
        )
