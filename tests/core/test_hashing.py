"""Tests for kvreuse.core.hashing (spec section 5): encoding, test vectors, extra keys, chains."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from depth import scaled
from kvreuse.core.encoding import TokenArray, enc
from kvreuse.core.hashing import digests
from kvreuse.core.hashing.digests import (
    ENCODED_ALGOS,
    HASH_ALGOS,
    algo_available,
    default_seed,
    make_digest,
    root_hash,
)
from kvreuse.core.hashing.hasher import Hasher
from kvreuse.core.hashing.keys import unit_extra_keys

SRC = Path(__file__).resolve().parents[2] / "src"


@dataclass(frozen=True)
class Item:
    identifier: str | bytes
    offset: int
    length: int


def u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def reference_chain(
    hasher: Hasher, tokens: list[int], lora=None, mm_items=(), cache_salt=None
) -> list[bytes]:
    """H[0..n] straight from spec 5.1/5.2, one enc() per unit: the oracle for Chain.extend."""
    u, la = hasher.hash_unit, hasher.lookahead
    hs = [hasher.root]
    for k in range(1, max(0, (len(tokens) - la) // u) + 1):
        x = unit_extra_keys(k, u, la, lora, mm_items, cache_salt)
        tok, succ = tokens[(k - 1) * u : k * u], tokens[k * u : k * u + la]
        hs.append(hasher.digest(enc(("kvr/unit", hs[-1], TokenArray(tok), TokenArray(succ), x))))
    return hs


# --------------------------------------------------------------------------- spec 5.6 vectors

VECTORS = [
    ("root", 0, 0, {}, "06810975dc0e98888988f5277974379df65cda4c001273f7eecacfb13ba02c32"),
    ("H1", 0, 16, {}, "0aca187b1be934efe6686c5ddcf58880264377eeb8c6908e4b84fc0bd15e9c20"),
    ("H2", 0, 32, {}, "49ff12579848f665571f9acac94396ad46119a0cd47d89b0f5c347302ca699cb"),
    (
        "H1 salt",
        0,
        16,
        {"cache_salt": "t1"},
        "1db89d88ebdfff94fc587155369fe629d7f9cde6101512ae110a570661a1a539",
    ),
    (
        "H1 lora",
        0,
        16,
        {"lora": ("fr", "/ad/v1")},
        "de49d23314ae5ebf8b088ac45f31ab1342a7c48e5bebe6e4a7d14f3a767bc473",
    ),
    (
        "H1 mm",
        0,
        16,
        {"mm_items": [Item("img-9f", 6, 4)]},
        "537bdc3ce5ef3dabed271b2ddaf4a33954d41c9719ca6dd93854ef4a32b126f8",
    ),
    ("root L1", 1, 0, {}, "33cce15865c6941959e181dc28ef84ac1771145dbb242c9cbf9dd7ff2d4db132"),
    ("H1 L1", 1, 17, {}, "69f369894ca511e5a9f259a81593adcc8cc0f809dfe2b86351db942b3e17b8c4"),
]


@pytest.mark.parametrize(
    ("name", "la", "ntok", "extra", "digest"), VECTORS, ids=[v[0] for v in VECTORS]
)
def test_spec_vectors(name: str, la: int, ntok: int, extra: dict, digest: str) -> None:
    hasher = Hasher("sha256", 16, la)
    hs = hasher.hash_units(list(range(ntok)), **extra)
    assert hs[-1].hex() == digest
    assert hs == reference_chain(hasher, list(range(ntok)), **extra)


def test_vector_root_from_definition() -> None:
    root = hashlib.sha256(enc(("kvr/root", "sha256", 16, 0, "kvreuse/v1"))).digest()
    assert root == root_hash("sha256", 16, 0, None) == Hasher().root
    assert root.hex() == VECTORS[0][-1]


# --------------------------------------------------------------------------- enc (spec 5.3)

ENC_CASES = [
    (None, b"\x00"),
    (0, b"\x01" + bytes(8)),
    (1, b"\x01" + bytes(7) + b"\x01"),
    (-1, b"\x01" + b"\xff" * 8),
    (2**63 - 1, b"\x01\x7f" + b"\xff" * 7),
    (-(2**63), b"\x01\x80" + bytes(7)),
    (b"", b"\x02" + u64(0)),
    (b"ab", b"\x02" + u64(2) + b"ab"),
    ("", b"\x03" + u64(0)),
    ("é", b"\x03" + u64(2) + b"\xc3\xa9"),
    ((), b"\x04" + u64(0)),
    ([], b"\x04" + u64(0)),
    (("a", 1), b"\x04" + u64(2) + b"\x03" + u64(1) + b"a" + b"\x01" + u64(1)),
    (["a", 1], b"\x04" + u64(2) + b"\x03" + u64(1) + b"a" + b"\x01" + u64(1)),
    (((),), b"\x04" + u64(1) + b"\x04" + u64(0)),
    (TokenArray(), b"\x05" + u64(0)),
    (TokenArray([1, 2**32 - 1]), b"\x05" + u64(2) + b"\x00\x00\x00\x01\xff\xff\xff\xff"),
]


@pytest.mark.parametrize(("value", "expected"), ENC_CASES, ids=repr)
def test_enc(value: object, expected: bytes) -> None:
    assert enc(value) == expected


ENC_ERRORS = [
    (True, TypeError),
    (False, TypeError),
    ((1, True), TypeError),
    (2**63, ValueError),
    (-(2**63) - 1, ValueError),
    ([2**64], ValueError),
    (1.0, TypeError),
    (bytearray(b"x"), TypeError),
    (memoryview(b"x"), TypeError),
    ({"a": 1}, TypeError),
    ({1}, TypeError),
    (object(), TypeError),
]


@pytest.mark.parametrize(("value", "exc"), ENC_ERRORS, ids=repr)
def test_enc_rejects(value: object, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        enc(value)


@pytest.mark.parametrize(
    ("tokens", "exc"),
    [
        ([-1], ValueError),
        ([2**32], ValueError),
        ([True], TypeError),
        ([1.0], TypeError),
        (["1"], TypeError),
        ([None], TypeError),
    ],
    ids=repr,
)
def test_token_array_rejects(tokens: list, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        TokenArray(tokens)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("ab", "c"), ("a", "bc")),
        ((b"ab", b"c"), (b"a", b"bc")),
        (TokenArray([1, 2]), (1, 2)),
        (TokenArray([1]), [1]),
        ("x", b"x"),
        ((), None),
        (((),), ()),
        ((TokenArray(), TokenArray([1])), (TokenArray([1]), TokenArray())),
    ],
    ids=repr,
)
def test_enc_unambiguous(a: object, b: object) -> None:
    assert enc(a) != enc(b)


# --------------------------------------------------------------------------- extra keys (5.2)

IMG = Item("img", 6, 10)


@pytest.mark.parametrize(
    ("k", "mm"),
    [
        (1, ()),
        (2, (("mm", "img", 2),)),
        (3, (("mm", "img", -2),)),
        (4, (("mm", "img", -6),)),
        (5, ()),
    ],
)
def test_mm_example_table(k: int, mm: tuple) -> None:
    assert unit_extra_keys(k, 4, 0, None, [IMG], None) == mm


def test_mm_example_chain_matches_reference() -> None:
    hasher = Hasher("sha256", 4, 0)
    toks = list(range(20))
    hs = hasher.hash_units(toks, mm_items=[IMG])
    assert hs == reference_chain(hasher, toks, mm_items=[IMG])
    plain = hasher.hash_units(toks)
    assert [a == b for a, b in zip(hs, plain, strict=True)] == [
        True,
        True,
        False,
        False,
        False,
        False,
    ]


@pytest.mark.parametrize(
    ("k", "la", "item", "expected"),
    [
        (1, 1, Item("i", 4, 1), (("mm", "i", 4),)),  # the successor window reaches the item
        (1, 0, Item("i", 4, 1), ()),
        (2, 1, Item("i", 4, 1), (("mm", "i", 0),)),
        (1, 0, Item("i", 2, 0), ()),  # an empty placeholder range meets nothing
        (2, 0, Item("i", 0, 5), (("mm", "i", -4),)),
        (3, 0, Item("i", 0, 8), ()),
    ],
)
def test_mm_window_edges(k: int, la: int, item: Item, expected: tuple) -> None:
    assert unit_extra_keys(k, 4, la, None, [item], None) == expected


def test_extra_keys_order() -> None:
    items = [Item("b", 3, 1), Item(b"z", 1, 1), Item("a", 1, 1), Item("c", 0, 1)]
    # by offset, then enc(identifier): bytes (tag 0x02) before str (0x03)
    assert unit_extra_keys(1, 4, 0, ("n", "p"), items, "s") == (
        ("lora", "n", "p"),
        ("mm", "c", 0),
        ("mm", b"z", 1),
        ("mm", "a", 1),
        ("mm", "b", 3),
        ("salt", "s"),
    )
    hasher = Hasher("sha256", 4, 0)
    toks = list(range(9))
    got = hasher.hash_units(toks, lora=("n", "p"), mm_items=items, cache_salt="s")
    assert got == reference_chain(hasher, toks, ("n", "p"), items, "s")
    assert got == hasher.hash_units(toks, lora=("n", "p"), mm_items=items[::-1], cache_salt="s")


def test_salt_only_on_unit_one() -> None:
    assert unit_extra_keys(1, 16, 0, None, (), "t1") == (("salt", "t1"),)
    assert unit_extra_keys(2, 16, 0, None, (), "t1") == ()
    assert unit_extra_keys(1, 16, 0, None, (), "") == ()
    hasher = Hasher()
    toks = list(range(48))
    salted = hasher.hash_units(toks, cache_salt="t1")
    assert salted == reference_chain(hasher, toks, cache_salt="t1")
    plain = hasher.hash_units(toks)
    assert salted[0] == plain[0]
    assert all(a != b for a, b in zip(salted[1:], plain[1:], strict=True))  # the chain carries it
    assert hasher.hash_units(toks, cache_salt="") == plain


def test_lora_on_every_unit() -> None:
    assert all(
        unit_extra_keys(k, 16, 0, ("fr", "/ad/v1"), (), None) == (("lora", "fr", "/ad/v1"),)
        for k in range(1, 5)
    )


def test_typed_keys_do_not_collide() -> None:
    hasher = Hasher()
    toks = list(range(16))
    variants = [
        {},
        {"cache_salt": "x"},
        {"lora": ("x", "")},
        {"lora": ("x", "x")},
        {"lora": ("ab", "c")},
        {"lora": ("a", "bc")},
        {"cache_salt": "salt"},
        {"mm_items": [Item("salt", 0, 16)]},
        {"mm_items": [Item(b"salt", 0, 16)]},
        {"mm_items": [Item("x", 0, 16)]},
        {"lora": ("salt", "x")},
    ]
    h1 = [hasher.hash_units(toks, **v)[1] for v in variants]
    assert len(set(h1)) == len(variants)


@pytest.mark.parametrize(
    "extra",
    [
        {"lora": ["a", "b"]},
        {"lora": ("a",)},
        {"lora": ("a", b"b")},
        {"cache_salt": b"x"},
        {"mm_items": [Item(1, 0, 1)]},  # type: ignore[arg-type]
        {"mm_items": [Item("i", 0.0, 1)]},  # type: ignore[arg-type]
    ],
    ids=repr,
)
def test_extra_key_types_rejected(extra: dict) -> None:
    with pytest.raises(TypeError):
        Hasher().chain(**extra)


# --------------------------------------------------------------------------- chains

tokens_st = st.lists(st.integers(0, 2**32 - 1), max_size=120)
items_st = st.lists(
    st.builds(
        Item, st.sampled_from(["a", "b", b"a", "img"]), st.integers(0, 100), st.integers(0, 30)
    ),
    max_size=4,
)


@settings(max_examples=scaled(150), deadline=None)
@given(
    tokens=tokens_st,
    u=st.integers(1, 9),
    la=st.integers(0, 3),
    cuts=st.lists(st.integers(0, 130), max_size=6),
    lora=st.none() | st.just(("fr", "/ad/v1")),
    items=items_st,
    salt=st.sampled_from([None, "", "t1"]),
    algo=st.sampled_from(ENCODED_ALGOS),
    as_tuple=st.booleans(),
)
def test_incremental_equals_one_shot(
    tokens: list[int], u: int, la: int, cuts: list[int], lora, items, salt, algo, as_tuple
) -> None:
    hasher = Hasher(algo, u, la, seed=b"fixed")
    extra = {"lora": lora, "mm_items": items, "cache_salt": salt}
    chain = hasher.chain(**extra)
    for cut in [*sorted(cuts), len(tokens)]:
        prefix = tokens[:cut]
        n = chain.extend(tuple(prefix) if as_tuple else prefix)
        assert n == chain.num_units == len(chain.hashes) - 1 == max(0, (len(prefix) - la) // u)
    assert chain.hashes == hasher.hash_units(tokens, **extra)
    assert chain.hashes == reference_chain(hasher, tokens, **extra)


def test_extend_returns_units_and_never_shrinks() -> None:
    hasher = Hasher("sha256", 4, 0)
    chain = hasher.chain()
    assert chain.hashes == [hasher.root] and chain.num_units == 0
    assert chain.extend([1, 2, 3]) == 0
    assert chain.extend([1, 2, 3, 4, 5]) == 1
    before = list(chain.hashes)
    assert chain.extend([1, 2]) == 1  # a shorter list hashes nothing and rehashes nothing
    assert chain.hashes == before
    assert chain.extend([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 2
    assert chain.hashes[:2] == before


@pytest.mark.parametrize(
    ("la", "ntok", "units"),
    [
        (0, 15, 0),
        (0, 16, 1),
        (1, 16, 0),
        (1, 17, 1),
        (1, 32, 1),
        (1, 33, 2),
        (2, 17, 0),
        (2, 18, 1),
        (2, 33, 1),
        (2, 34, 2),
        (3, 2, 0),
    ],
)
def test_lookahead_hashes_only_units_with_successors(la: int, ntok: int, units: int) -> None:
    assert Hasher("sha256", 16, la).chain().extend(list(range(ntok))) == units


def test_lookahead_successors_are_keyed() -> None:
    hasher = Hasher("sha256", 16, 1)
    a = hasher.hash_units([*range(16), 100])
    b = hasher.hash_units([*range(16), 101])
    assert a[1] != b[1]
    assert Hasher("sha256", 16, 0).hash_units(list(range(17)))[1] != a[1]


@pytest.mark.parametrize("algo", ENCODED_ALGOS)
def test_unit_hash_is_one_link(algo: str) -> None:
    hasher = Hasher(algo, 4, 1, seed="s")
    toks = list(range(13))
    hs = hasher.hash_units(toks, lora=("n", "p"), cache_salt="t")
    x2 = unit_extra_keys(2, 4, 1, ("n", "p"), (), "t")
    assert hasher.unit_hash(hs[1], toks[4:8], toks[8:9], x2) == hs[2]


@pytest.mark.parametrize(
    ("algo", "u", "la"), [("sha256", 16, 0), ("sha256", 4, 3), ("xxh3_128", 8, 1)]
)
def test_unit_template_splices_exactly_enc(algo: str, u: int, la: int) -> None:
    """The template's constant pieces around the variable ones are the normative encoding."""
    hasher = Hasher(algo, u, la, seed="s")
    t = hasher.template
    assert (t.hash_unit, t.lookahead, t.root, t.digest) == (u, la, hasher.root, hasher.digest)
    parent, toks, succ, x = hasher.root, list(range(u)), list(range(100, 100 + la)), (("k", 1),)
    spliced = t.pre + parent + t.mid + _tok(toks) + t.la_hdr + _tok(succ) + enc(x)
    assert spliced == enc(("kvr/unit", parent, TokenArray(toks), TokenArray(succ), x))
    assert t.unit_struct.size == 4 * u
    if t.ctor is not None:
        assert t.ctor(spliced).digest() == t.digest(spliced)


def _tok(tokens: list[int]) -> bytes:
    return b"".join(x.to_bytes(4, "big") for x in tokens)


def test_chains_hold_the_hasher_s_frozen_template() -> None:
    hasher = Hasher("sha256", 16, 0)
    a, b = hasher.chain(), hasher.chain(cache_salt="t")
    assert a.template is b.template is hasher.template
    with pytest.raises(dataclasses.FrozenInstanceError):
        hasher.template.hash_unit = 8  # type: ignore[misc]
    assert not any(name.startswith("_") for name in vars(hasher))  # nothing private to read


# --------------------------------------------------------------------------- digests, seeds, roots


@pytest.mark.parametrize(("algo", "size"), [("sha256", 32), ("xxh3_128", 16), ("blake3", 32)])
def test_make_digest(algo: str, size: int) -> None:
    d = make_digest(algo)
    assert len(d(b"abc")) == size
    if algo == "sha256":
        assert d(b"abc") == hashlib.sha256(b"abc").digest()
    if algo == "xxh3_128":
        import xxhash

        assert d(b"abc") == xxhash.xxh3_128(b"abc", seed=0).digest()
    if algo == "blake3":
        import blake3

        assert d(b"abc") == blake3.blake3(b"abc").digest()


def test_algo_available(monkeypatch: pytest.MonkeyPatch) -> None:
    assert all(algo_available(a) for a in HASH_ALGOS)
    assert not algo_available("md5")
    monkeypatch.setitem(sys.modules, "xxhash", None)  # makes `import xxhash` fail
    assert not algo_available("xxh3_128")
    with pytest.raises(ImportError, match="pip install xxhash"):
        Hasher("xxh3_128", seed=b"s")


def test_roots_separate_configurations() -> None:
    roots = {
        root_hash(algo, u, la, seed)
        for algo in ENCODED_ALGOS
        for u in (1, 16)
        for la in (0, 1)
        for seed in ("a", b"a", "b")
    }
    assert len(roots) == 3 * 2 * 2 * 3


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"algo": "md5"}, ValueError),
        ({"hash_unit": 0}, ValueError),
        ({"hash_unit": True}, ValueError),
        ({"lookahead": -1}, ValueError),
        ({"seed": 1}, TypeError),
    ],
    ids=repr,
)
def test_hasher_rejects(kwargs: dict, exc: type[Exception]) -> None:
    with pytest.raises(exc):
        Hasher(**kwargs)


def test_default_seed_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    assert default_seed("sha256") == "kvreuse/v1"
    monkeypatch.setattr(digests, "_random_seed", None)
    with pytest.warns(UserWarning, match="random per-process seed"):
        seed = default_seed("xxh3_128")
    assert isinstance(seed, bytes) and len(seed) == 32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert default_seed("xxh3_128") == seed  # drawn once per process, warned once
        assert default_seed("blake3") == seed
    with pytest.raises(ValueError):
        default_seed("md5")


def test_unseeded_fast_hasher_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digests, "_random_seed", None)
    with pytest.warns(UserWarning):
        unseeded = Hasher("blake3")
    assert unseeded.root == Hasher("blake3", seed=digests._random_seed).root


ROOT_SCRIPT = (
    "import sys, warnings; warnings.simplefilter('ignore'); from kvreuse.core.hashing.hasher "
    "import Hasher; a = sys.argv[1]; s = sys.argv[2] or None; "
    "print(Hasher(a, seed=s).hash_units(list(range(40)))[-1].hex())"
)


def _remote_hash(algo: str, seed: str | None) -> str:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run(
        [sys.executable, "-c", ROOT_SCRIPT, algo, seed or ""],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.strip()


@pytest.mark.parametrize("algo", ["xxh3_128", "blake3"])
def test_fast_algos_across_processes(algo: str) -> None:
    assert _remote_hash(algo, None) != _remote_hash(algo, None)
    seeded = _remote_hash(algo, "shared")
    assert seeded == _remote_hash(algo, "shared")
    assert seeded == Hasher(algo, seed="shared").hash_units(list(range(40)))[-1].hex()


def test_sha256_reproducible_across_processes() -> None:
    here = Hasher().hash_units(list(range(40)))[-1].hex()
    assert _remote_hash("sha256", None) == here


def test_a_placeholder_reaching_far_beyond_the_tokens_hashes_per_unit() -> None:
    """An item of 2**40 tokens must not make the chain enumerate its units up front (it once
    did: add_request never returned); the keys of the units hashed equal the definition's."""
    h = Hasher("sha256", 4, 0)
    item = Item("img", 2, 2**40)
    chain = h.chain(mm_items=(item,))
    tokens = list(range(12))
    chain.extend(tokens)
    parent = h.template.root
    for k in range(1, 4):
        extra = unit_extra_keys(k, 4, 0, None, (item,), None)
        parent = h.unit_hash(parent, tokens[(k - 1) * 4 : k * 4], (), extra)
        assert chain.hashes[k] == parent
