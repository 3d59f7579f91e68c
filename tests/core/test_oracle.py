"""The brute-force oracle (spec §15) against the spec's worked examples, plus its own properties.

Entry sets are written directly as (group, boundary, ident) triples, the way the spec's examples
describe what a producer published; nothing here hashes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from depth import scaled
from kvreuse.core.config import CacheConfig, Geometry, GroupGeometry
from kvreuse.core.config import GroupSpec as G
from kvreuse.oracle import (
    Entry,
    IdentBook,
    OracleRequest,
    copy_boundary,
    expected_slots,
    extra_keys,
    ident,
    num_units,
    oracle,
)


# ----------------------------------------------------------------------------- builders
def geo(groups: list[G], dcp: int = 1, **kw: object) -> Geometry:
    return CacheConfig(num_blocks=64, dcp_size=dcp, groups=groups, **kw).geometry  # type: ignore[arg-type]


GEO_P = geo([G("full", 16)], dcp=4)
GEO_H = geo([G("full", 16), G("recurrent", 16)], dcp=4)
GEO_3 = geo([G("full", 16), G("sliding", 32, window=48), G("recurrent", 32)], dcp=4)
GEO_C = geo([G("full", 16), G("chunked", 32, chunk=64)], dcp=4)
GEO_L = geo([G("full", 2048), G("recurrent", 256)], dcp=4)
DRAFT = G("full", 64, dcp_sharded=False, role="draft")


def geo_d(mode: str = "drop", lookahead: int = 1) -> Geometry:
    """Geo-D: Geo-H plus an unsharded draft full group (B = 64)."""
    groups = [G("full", 16), G("recurrent", 16), DRAFT]
    return geo(groups, dcp=4, spec_mode=mode, lookahead_tokens=lookahead)


def geo_h(mode: str = "none", lookahead: int = 1) -> Geometry:
    return geo(
        [G("full", 16), G("recurrent", 16)], dcp=4, spec_mode=mode, lookahead_tokens=lookahead
    )


def seq(n: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def other(n: int) -> tuple[int, ...]:
    """Tokens no `seq` prompt contains (a divergent suffix)."""
    return seq(n, 50_000)


def req(tokens: tuple[int, ...], prompt_len: int | None = None, **kw: object) -> OracleRequest:
    return OracleRequest(tokens, len(tokens) if prompt_len is None else prompt_len, **kw)  # type: ignore[arg-type]


def finished(prompt: tuple[int, ...], outputs: int = 1, **kw: object) -> OracleRequest:
    """A producer after its prompt and `outputs` sampled tokens (T = N − 1)."""
    return req(prompt + other(outputs), len(prompt), **kw)


def published(
    g: Geometry,
    producer: OracleRequest,
    states: Iterable[int] = (),
    groups: Iterable[int] | None = None,
) -> set[Entry]:
    """What `producer` published: every boundary up to min(T, n·u) in each cacheable attention
    group (T = N − 1, 10.2), and a state at each of `states` in each recurrent group (10.4)."""
    u, n = g.hash_unit, num_units(g, producer)
    end = min(len(producer.tokens) - 1, n * u)
    wanted = set(range(len(g.groups))) if groups is None else set(groups)
    out: set[Entry] = set()
    for grp in g.groups:
        if not grp.cacheable or grp.group_id not in wanted:
            continue
        points = list(states) if grp.kind == "recurrent" else range(u, end + 1, u)
        out |= {(grp.group_id, b, ident(g, producer, b)) for b in points}
    return out


def drop(entries: set[Entry], group: int, boundaries: Iterable[int]) -> set[Entry]:
    """The entries of `group` at `boundaries` (for eviction: remove them, put them in a ghost)."""
    bs = set(boundaries)
    return {e for e in entries if e[0] == group and e[1] in bs}


# ----------------------------------------------------------------------------- worked examples
@dataclass
class Case:
    geo: Geometry
    req: OracleRequest
    entries: set[Entry]
    hit: int
    reason: str
    junction: int | None = None
    ghost: set[Entry] = field(default_factory=set)
    slots: dict[int, list[str]] | None = None


def _geo_l() -> dict[str, Case]:
    a2048 = finished(seq(2048))  # committed its prefill: entries 256 … 2048
    e2048 = published(GEO_L, a2048, states=[1792])
    a2049 = finished(seq(2049))
    e2049 = published(GEO_L, a2049, states=[2048])
    q = finished(seq(1792))  # edge case 4: Q's page-0 block is evicted afterwards
    q_keys = published(GEO_L, q, groups=[0])
    # Q's block is gone; A's page-0 copy kept only its own key 2048; Q's states remain.
    covering = drop(e2048, 0, [2048]) | published(GEO_L, q, states=[1536, 1792], groups=[1])
    long_a = req(seq(2048) + other(1000), 2048)  # edge case 5: A generated 1000 tokens
    return {
        "7.2 resend 2048": Case(
            GEO_L, req(seq(2048)), e2048, 1792, "cap_reached", slots={0: ["copy"]}
        ),
        "7.2 resend 2049": Case(GEO_L, req(seq(2049)), e2049, 2048, "cap_reached"),
        "7.2 divergent suffix": Case(
            GEO_L, req(seq(1900) + other(148)), e2048, 1792, "cap_reached"
        ),
        "7.2 covering rule": Case(GEO_L, req(seq(2048)), covering, 1792, "cap_reached"),
        "16.4 without covering entry": Case(
            GEO_L,
            req(seq(2048)),
            covering - drop(covering, 0, [2048]),
            0,
            "evicted",
            ghost=drop(covering, 0, [2048]) | q_keys,
        ),
        "12.3 evicted: only a covering key was lost": Case(
            GEO_L,
            req(seq(2048)),
            covering - drop(covering, 0, [2048]),
            0,
            "evicted",
            ghost=drop(covering, 0, [2048]),
        ),
        "16.5 entries survive generation": Case(
            GEO_L, req(seq(2048)), published(GEO_L, long_a, states=[1792]), 1792, "cap_reached"
        ),
    }


def _junction() -> dict[str, Case]:
    a = finished(seq(200))
    ea = published(GEO_H, a, states=[192])
    b = req(seq(150) + other(70))
    eb = published(GEO_H, finished(b.tokens), states=[144, 128, 208, 192])
    c = req(seq(150) + seq(80, 90_000))
    a208 = finished(seq(208))
    e208 = published(GEO_H, a208, states=[192, 208])
    geo_h2 = geo([G("full", 16), G("recurrent", 16), G("full", 16)], dcp=4)
    e2 = published(geo_h2, a, states=[192])
    return {
        "7.9 B": Case(GEO_H, b, ea, 0, "recurrent_limited", junction=144),
        "7.9 C": Case(GEO_H, c, ea | eb, 144, "no_entry", slots={0: ["full", "full", "copy"]}),
        "16.10 no rewinding": Case(
            GEO_H,
            req(seq(200)),
            e208 - drop(e208, 1, [192]),
            0,
            "recurrent_limited",
            junction=192,
            ghost=drop(e208, 1, [192]),
        ),
        "16.34 junction over all attention": Case(
            geo_h2, b, e2 - drop(e2, 2, [80, 96, 112, 128]), 0, "recurrent_limited", junction=64
        ),
    }


def _geo_p() -> dict[str, Case]:
    a200 = published(GEO_P, finished(seq(200)))
    a256 = published(GEO_P, finished(seq(256)))
    page1 = drop(a256, 0, [80, 96, 112, 128])
    a180 = published(GEO_P, finished(seq(180), outputs=13))  # decoded past 192: T = 192
    page2 = drop(a180, 0, [144, 160, 176, 192])
    two_full = geo([G("full", 16), G("full", 16)], dcp=4)
    two = published(two_full, finished(seq(200)))
    two_page1 = drop(two, 1, [80, 96, 112, 128])
    return {
        "16.1 prompt within one unit": Case(
            GEO_H, req(seq(16)), published(GEO_H, finished(seq(16)), states=[16]), 0, "below_unit"
        ),
        "16.1 ten tokens": Case(GEO_H, req(seq(10)), set(), 0, "below_unit"),
        "16.2 one past a unit": Case(
            GEO_H,
            req(seq(17)),
            published(GEO_H, finished(seq(17)), states=[16]),
            16,
            "cap_reached",
            slots={0: ["copy"]},
        ),
        "16.3 page-aligned prompt": Case(
            GEO_P,
            req(seq(128)),
            published(GEO_P, finished(seq(128))),
            112,
            "cap_reached",
            slots={0: ["full", "copy"]},
        ),
        "16.7 divergence after a page end": Case(
            GEO_P, req(seq(150) + other(70)), a200, 144, "no_entry"
        ),
        "16.8 shorter prefix": Case(GEO_P, req(seq(180)), a200, 176, "cap_reached"),
        "16.23 evicted middle page": Case(
            GEO_P, req(seq(256)), a256 - page1, 64, "evicted", ghost=page1, slots={0: ["full"]}
        ),
        "16.23 same, no ghost record": Case(GEO_P, req(seq(256)), a256 - page1, 64, "no_entry"),
        "16.24 eviction removes every key": Case(
            GEO_P, req(seq(180)), a180 - page2, 128, "evicted", ghost=page2
        ),
        "12.3 g* is the full group with the smallest F": Case(
            two_full,
            req(seq(200)),
            two - two_page1,
            64,
            "evicted",
            ghost=two_page1,
        ),
        "16.28 after reset": Case(GEO_P, req(seq(200)), set(), 0, "no_entry"),
        "16.30 skip_read": Case(GEO_P, req(seq(200), skip_read=True), a200, 0, "skip_read"),
        "disabled by config": Case(
            geo([G("full", 16)], dcp=4, enable_prefix_caching=False),
            req(seq(200)),
            a200,
            0,
            "disabled",
        ),
        "disabled, no cacheable group": Case(
            geo([G("full", 16, prefix_cacheable=False)]), req(seq(200)), a200, 0, "disabled"
        ),
    }


def _isolation() -> dict[str, Case]:
    salted = published(GEO_P, finished(seq(200), cache_salt="t1"))
    lora = published(GEO_P, finished(seq(200), lora=("fr", "/ad/v1")))
    img = (("img-9f", 20, 40),)
    mm = published(GEO_P, finished(seq(200), mm_items=img))
    plain = published(GEO_P, finished(seq(200)))
    cases = {
        "16.11 salt t2": (salted, {"cache_salt": "t2"}, 0),
        "16.11 unsalted": (salted, {}, 0),
        "16.11 salt t1": (salted, {"cache_salt": "t1"}, 192),
        "16.11 salted request, unsalted producer": (plain, {"cache_salt": "t1"}, 0),
        "16.11 empty salt is no salt": (plain, {"cache_salt": ""}, 192),
        "16.12 LoRA path": (lora, {"lora": ("fr", "/ad/v2")}, 0),
        "16.12 no LoRA": (lora, {}, 0),
        "16.12 same LoRA": (lora, {"lora": ("fr", "/ad/v1")}, 192),
        "16.13 image offset": (mm, {"mm_items": (("img-9f", 36, 40),)}, 16),
        "16.13 image identifier": (mm, {"mm_items": (("img-00", 20, 40),)}, 16),
        "16.13 same image": (mm, {"mm_items": img}, 192),
    }
    return {
        name: Case(GEO_P, req(seq(200), **kw), e, h, "cap_reached" if h == 192 else "no_entry")
        for name, (e, kw, h) in cases.items()
    }


def _windows() -> dict[str, Case]:
    sliding = geo([G("sliding", 32, window=48)], hash_unit=16)
    s_keys = drop(published(sliding, finished(seq(200))), 0, [160, 176])
    a3 = finished(seq(200))
    sparse = published(GEO_3, a3, states=[192])
    dense = published(GEO_3, a3, states=range(32, 193, 32))
    sl_page3 = drop(dense, 1, [112, 128])
    b = req(seq(150) + other(70))
    c150 = published(GEO_C, finished(seq(150)))
    geo_3d = geo(
        [G("full", 16), G("sliding", 32, window=48), G("recurrent", 32), DRAFT],
        dcp=4,
        spec_mode="drop",
    )
    e35 = published(geo_3d, a3, states=[176, 160, 128])  # ρ, its M and S floors; φ(200) = 176
    return {
        "7.3 sliding x = 176": Case(
            sliding,
            req(seq(200)),
            s_keys,
            176,
            "window_limited",
            slots={0: ["null"] * 4 + ["full", "copy"]},
        ),
        "7.3 not downward-closed": Case(sliding, req(seq(170)), s_keys, 0, "window_limited"),
        "16.32 resend": Case(
            GEO_3,
            req(seq(200)),
            sparse,
            192,
            "cap_reached",
            slots={0: ["full"] * 3, 1: ["null"] * 4 + ["full", "full"]},
        ),
        "16.32 sibling": Case(GEO_3, b, sparse, 0, "recurrent_limited", junction=144),
        "16.32 dense states, sliding page evicted": Case(
            GEO_3,
            b,
            dense - sl_page3,
            96,
            "window_limited",
            ghost=sl_page3,
            slots={0: ["full", "copy"], 1: ["null", "full", "full"]},
        ),
        "16.33 chunk start": Case(
            GEO_C,
            req(seq(200) + other(100)),
            published(GEO_C, finished(seq(200))),
            192,
            "no_entry",
            slots={0: ["full"] * 3, 1: ["null"] * 6},
        ),
        "16.33 150-token resend": Case(
            GEO_C,
            req(seq(150)),
            c150,
            144,
            "cap_reached",
            slots={0: ["full", "full", "copy"], 1: ["null"] * 4 + ["copy"]},
        ),
        "16.33 chunked page missing": Case(
            GEO_C, req(seq(150)), c150 - drop(c150, 1, [144]), 128, "window_limited"
        ),
        "16.35 three groups with drop": Case(
            geo_3d,
            req(seq(200)),
            e35,
            176,
            "spec_decode_rewind",
            slots={
                0: ["full", "full", "copy"],
                1: ["null"] * 4 + ["full", "copy"],
                3: ["full", "full", "copy"],
            },
        ),
    }


def _spec_modes() -> dict[str, Case]:
    d = geo_d()
    a = finished(seq(200), outputs=40)  # T = 239: publishes up to 224
    turn2 = req(a.tokens + seq(60, 70_000), 300)
    states = [176, 128]  # replay ρ(200) = 176 and its S floor
    return {
        "16.17 drop 200": Case(
            d, req(seq(200)), published(d, finished(seq(200)), [176]), 176, "spec_decode_rewind"
        ),
        "16.17 lookahead 200": Case(
            geo_d("lookahead"),
            req(seq(200)),
            published(geo_d("lookahead"), finished(seq(200)), [192]),
            192,
            "cap_reached",
        ),
        "16.18 continuation": Case(
            d, turn2, published(d, a, [*states, 208]), 208, "spec_decode_rewind"
        ),
        "16.18 without the φ shift": Case(
            d, turn2, published(d, a, [*states, 224]), 176, "recurrent_limited", junction=208
        ),
    }


CASES: dict[str, Case] = {
    **_geo_l(),
    **_junction(),
    **_geo_p(),
    **_isolation(),
    **_windows(),
    **_spec_modes(),
}


@pytest.mark.parametrize("name", list(CASES))
def test_worked_example(name: str) -> None:
    case = CASES[name]
    result = oracle(case.geo, case.req, case.entries, case.ghost)
    assert (result.hit, result.reason, result.junction) == (case.hit, case.reason, case.junction)
    if case.slots is not None:
        slots = expected_slots(case.geo, case.req, case.entries, result.hit)
        assert slots == case.slots


# ----------------------------------------------------------------------------- replay grid (§8)
GRID = [  # (geometry, mode, L, P, ρ(P))
    *[(gname, "none", 1, p, 192) for gname in ("H", "D") for p in (193, 200, 208)],
    *[(gname, "lookahead", 1, p, 192) for gname in ("H", "D") for p in (193, 200, 208)],
    *[
        (gname, "lookahead", 2, p, h)
        for gname in ("H", "D")
        for p, h in ((193, 176), (200, 192), (208, 192))
    ],
    *[("D", "drop", 1, p, h) for p, h in ((193, 176), (200, 176), (208, 192))],
]


def replay_point(mode: str, lookahead: int, prompt: int, u: int = 16) -> int:
    """ρ(P) by the formulas of the §8 table."""
    if mode == "drop":
        return max(0, prompt // u * u - u)
    return (prompt - (lookahead if mode == "lookahead" else 1)) // u * u


@pytest.mark.parametrize(("gname", "mode", "lookahead", "prompt", "expected"), GRID)
@pytest.mark.parametrize("states", ["replay point", "every boundary"])
def test_replay_grid(
    gname: str, mode: str, lookahead: int, prompt: int, expected: int, states: str
) -> None:
    g = (geo_h if gname == "H" else geo_d)(mode, lookahead)
    rho = replay_point(mode, lookahead, prompt)
    assert rho == expected  # the table's column agrees with its formula
    producer = finished(seq(prompt))
    n_u = num_units(g, producer) * g.hash_unit
    points = [rho] if states == "replay point" else range(16, n_u + 1, 16)
    result = oracle(g, req(seq(prompt)), published(g, producer, states=points), ())
    assert result.hit == expected
    rewound = result.hit < result.top
    assert result.reason == ("spec_decode_rewind" if rewound else "cap_reached")
    assert rewound == (mode == "drop" and prompt % 16 != 0)


# ----------------------------------------------------------------------------- idents (5.2, 15.1)
U4 = geo([G("full", 4)])


def test_extra_keys_mm_example_of_5_2() -> None:
    r = req(seq(20), mm_items=(("img", 6, 10),))
    got = [extra_keys(U4, r, k) for k in range(1, 6)]
    assert got == [(), (("mm", "img", 2),), (("mm", "img", -2),), (("mm", "img", -6),), ()]


def test_extra_keys_order_and_scope() -> None:
    items = (("b", 5, 4), ("aa", 5, 4), (b"zz", 5, 4), ("x", 4, 1))
    r = req(seq(20), lora=("fr", "/ad"), mm_items=items, cache_salt="s")
    assert extra_keys(U4, r, 1) == (("lora", "fr", "/ad"), ("salt", "s"))
    assert extra_keys(U4, r, 2) == (
        ("lora", "fr", "/ad"),
        ("mm", "x", 0),
        ("mm", b"zz", 1),
        ("mm", "b", 1),
        ("mm", "aa", 1),
    )
    assert extra_keys(U4, r, 3) == (
        ("lora", "fr", "/ad"),
        ("mm", b"zz", -3),
        ("mm", "b", -3),
        ("mm", "aa", -3),
    )
    assert extra_keys(U4, req(seq(8), cache_salt=""), 1) == ()


def test_lookahead_window_includes_successors() -> None:
    g = geo_h("lookahead", 1)
    r = req(seq(40), mm_items=(("img", 16, 4),))
    assert extra_keys(g, r, 1) == (("mm", "img", 16),)  # window [0, 17)
    assert ident(g, r, 16)[0] == seq(17)
    assert extra_keys(GEO_H, r, 1) == ()


def test_typed_keys_do_not_collide() -> None:  # edge case 14
    t = seq(16)
    variants = [
        req(t, cache_salt="x"),
        req(t, lora=("x", "")),
        req(t, lora=("ab", "c")),
        req(t, lora=("a", "bc")),
        req(t, mm_items=(("salt", 0, 1),)),
        req(t),
    ]
    assert len({ident(GEO_P, v, 16) for v in variants}) == len(variants)


@pytest.mark.parametrize("b", [0, 8, 32])
def test_ident_rejects_unhashed_boundaries(b: int) -> None:
    with pytest.raises(ValueError):
        ident(GEO_P, req(seq(20)), b)


def test_non_cacheable_group_is_invisible() -> None:
    g = geo([G("full", 16), G("sliding", 32, window=48, prefix_cacheable=False)], dcp=4)
    entries = published(g, finished(seq(150)))
    result = oracle(g, req(seq(150)), entries)
    assert (result.hit, result.reason) == (144, "cap_reached")
    assert expected_slots(g, req(seq(150)), entries, 144) == {
        0: ["full", "full", "copy"],
        1: ["null"] * 5,
    }
    assert copy_boundary(g, req(seq(150)), entries, 0, 144) == 144


# ----------------------------------------------------------------------------- IdentBook
def fake_hasher(g: Geometry) -> Callable[[OracleRequest], list[bytes]]:
    def chain(r: OracleRequest) -> list[bytes]:
        n = num_units(g, r)
        return [b"root"] + [
            hashlib.sha256(repr(ident(g, r, k * 16)).encode()).digest() for k in range(1, n + 1)
        ]

    return chain


def test_ident_book_maps_exports() -> None:
    book = IdentBook(GEO_H, fake_hasher(GEO_H))
    a, b = finished(seq(100)), req(seq(40) + other(30))
    book.add(a)
    book.add(b)
    h = fake_hasher(GEO_H)
    rows = [(0, 32, h(a)[2], "partial", 5), (1, 48, h(b)[3], "state", 7)]
    assert book.entries(rows) == {(0, 32, ident(GEO_H, a, 32)), (1, 48, ident(GEO_H, b, 48))}
    assert book.ghost([(0, 64, h(a)[4])]) == {(0, 64, ident(GEO_H, a, 64))}
    with pytest.raises(AssertionError, match="unmapped"):
        book.entries([(0, 16, b"\x00" * 32, "partial", 1)])
    with pytest.raises(AssertionError, match="after 2 units"):
        book.ghost([(0, 48, h(a)[2])])


def test_ident_book_detects_bad_hashers() -> None:
    constant = IdentBook(GEO_P, lambda r: [b"x"] * (num_units(GEO_P, r) + 1))
    with pytest.raises(AssertionError, match="two different prefixes"):
        constant.add(req(seq(40)))
    short = IdentBook(GEO_P, lambda r: [b"x"])
    with pytest.raises(AssertionError, match="expected n"):
        short.add(req(seq(40)))
    base = fake_hasher(GEO_P)
    unstable = IdentBook(GEO_P, lambda r: [h + bytes([len(r.tokens)]) for h in base(r)])
    unstable.add(req(seq(40)))
    with pytest.raises(AssertionError, match="hashed two ways"):
        unstable.add(req(seq(50)))


# ----------------------------------------------------------------------------- properties (15.3)
PROP_GEOS = [
    GEO_P,
    GEO_H,
    GEO_3,
    GEO_C,
    geo_d(),
    geo_d("lookahead", 2),
    geo(
        [G("full", 16), G("sliding", 16, window=20), G("chunked", 32, chunk=64), G("recurrent", 16)]
    ),
    geo(
        [G("full", 16), G("sliding", 32, window=48), G("recurrent", 32), DRAFT],
        dcp=4,
        spec_mode="drop",
    ),
    geo([G("sliding", 32, window=40, role="draft"), G("full", 32)], hash_unit=16, spec_mode="drop"),
    geo([G("sliding", 32, window=33), G("chunked", 32, chunk=96), G("recurrent", 16)]),
    geo([G("full", 16), G("sliding", 16, window=17)], hash_unit=8, spec_mode="lookahead"),
]


@st.composite
def requests(draw: st.DrawFn, min_len: int = 1, max_len: int = 180) -> OracleRequest:
    """Requests on a common base sequence that diverge at a random point."""
    length = draw(st.integers(min_len, max_len))
    split = draw(st.just(length) | st.integers(0, length))
    branch = draw(st.integers(0, 2))
    tokens = seq(split) + tuple(branch * 1000 + i for i in range(split, length))
    salt = draw(st.sampled_from([None, None, "", "t"]))
    mm = draw(st.sampled_from([(), (("img", 20, 40),)]))
    return OracleRequest(tokens, length, cache_salt=salt, mm_items=mm)


def universe(g: Geometry, producers: Sequence[OracleRequest]) -> list[Entry]:
    """Every entry the producers could have published, in a deterministic order."""
    out: dict[Entry, None] = {}
    for p in producers:
        n = num_units(g, p)
        for grp in g.groups:
            for b in range(g.hash_unit, n * g.hash_unit + 1, g.hash_unit):
                if grp.cacheable:
                    out[(grp.group_id, b, ident(g, p, b))] = None
    return list(out)


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[Geometry, OracleRequest, set[Entry], set[Entry], set[Entry]]:
    """(geometry, request, E, E′ ⊇ E, ghost): E′ keeps most of the universe, E loses some more."""
    g = draw(st.sampled_from(PROP_GEOS))
    producers = draw(st.lists(requests(min_len=32), min_size=1, max_size=3))
    everything = universe(g, producers)
    holes = st.lists(st.integers(0, max(0, len(everything) - 1)), max_size=12)
    gone = {everything[i] for i in draw(holes)} if everything else set()
    bigger = set(everything) - gone
    fewer = {everything[i] for i in draw(holes)} if everything else set()
    query = draw(requests())
    if draw(st.integers(0, 2)):  # mostly a prefix or an extension of a producer
        base = draw(st.sampled_from(producers))
        length = draw(st.integers(17, len(base.tokens) + 40))
        tokens = (base.tokens + seq(40, 7_000))[:length]
        query = OracleRequest(tokens, length, cache_salt=base.cache_salt, mm_items=base.mm_items)
    return g, query, bigger - fewer, bigger, gone


PROPS = settings(
    max_examples=scaled(150), deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
REASONS = {
    "below_unit",
    "cap_reached",
    "recurrent_limited",
    "window_limited",
    "spec_decode_rewind",
    "evicted",
    "no_entry",
}


@PROPS
@given(scenarios())
def test_t2_range_and_bounds(scenario: tuple) -> None:
    g, r, _, entries, ghost = scenario
    result = oracle(g, r, entries, ghost)
    u, n = g.hash_unit, num_units(g, r)
    assert result.n == n and result.top <= len(r.tokens) - 1
    assert result.hit <= len(r.tokens) - 1 and result.hit % u == 0 and result.hit <= n * u
    a1, a2, a3, a4 = result.bounds
    assert result.top >= a1 >= a2 >= a3 >= a4 == result.hit
    assert result.reason in REASONS
    assert result.junction is None or result.junction > result.hit
    assert oracle(g, r, entries, ()).reason != "evicted"


@PROPS
@given(scenarios())
def test_t3_monotonic(scenario: tuple) -> None:
    g, r, smaller, bigger, ghost = scenario
    assert oracle(g, r, smaller, ghost).hit <= oracle(g, r, bigger, ghost).hit


class FastGroup:
    """One group's acceptance by the precomputed run[j]/hi[j] tables of the note in 7.7."""

    def __init__(
        self, g: Geometry, r: OracleRequest, entries: set[Entry], grp: GroupGeometry
    ) -> None:
        self.geo, self.grp, self.u = g, grp, g.hash_unit
        self.nu = num_units(g, r) * self.u
        has = {
            b
            for b in range(self.u, self.nu + 1, self.u)
            if (grp.group_id, b, ident(g, r, b)) in entries
        }
        self.states = has
        B, pages = grp.page_size, -(-self.nu // grp.page_size)
        self.run, self.hi, run = [], [0] * pages, 0
        for j in range(pages):
            run = run + 1 if (j + 1) * B in has else 0
            self.run.append(run)
        for b in sorted(has):
            self.hi[(b - 1) // B] = b

    def own(self, x: int) -> bool:
        grp, B = self.grp, self.grp.page_size
        if x == 0:
            return True
        if grp.kind == "recurrent":
            return x in self.states
        if grp.kind == "sliding":
            lo = max(0, x - (grp.window or 0) + 1)
        elif grp.kind == "chunked":
            lo = x // (grp.chunk or 1) * (grp.chunk or 1)
            if lo == x:
                return True
        else:
            lo = 0
        p = (x - 1) // B
        run_before = self.run[p - 1] if p >= 1 else 0
        return run_before >= p - lo // B and self.hi[p] >= x

    def accepts(self, x: int) -> bool:
        if self.geo.spec_mode == "drop" and self.grp.role == "draft" and x > 0:
            return x + self.u <= self.nu and self.own(x + self.u) and self.own(x)
        return self.own(x)

    def largest(self, c: int) -> int:  # m_g(c) of 7.7
        return next((x for x in range(c, 0, -self.u) if self.accepts(x)), 0)


def fixed_point(top: int, groups: list[FastGroup]) -> int:
    x, changed = top, True
    while changed:
        changed = False
        for fg in groups:
            y = fg.largest(x)
            if y < x:
                x, changed = y, True
    return x


@PROPS
@given(scenarios())
def test_hit_is_the_largest_common_candidate(scenario: tuple) -> None:
    g, r, entries, _, ghost = scenario
    result = oracle(g, r, entries, ghost)
    if not g.caching_enabled:
        return
    groups = [FastGroup(g, r, entries, grp) for grp in g.groups if grp.cacheable]
    assert all(fg.accepts(result.hit) for fg in groups)
    for x in range(result.hit + g.hash_unit, result.top + 1, g.hash_unit):
        assert not all(fg.accepts(x) for fg in groups), f"{x} is accepted by every group"
    assert fixed_point(result.top, groups) == result.hit
    nonrec = [fg for fg in groups if fg.grp.kind != "recurrent"]
    assert fixed_point(result.top, nonrec) == result.bounds[2]
    for gid, marks in expected_slots(g, r, entries, result.hit).items():
        grp = g.groups[gid]
        assert len(marks) == -(-result.hit // grp.page_size)
        for j, mark in enumerate(marks):
            key = (gid, (j + 1) * grp.page_size)
            if mark == "full":
                assert (*key, ident(g, r, key[1])) in entries, f"group {gid}: page {j} unkeyed"
            if mark == "copy":
                b = copy_boundary(g, r, entries, gid, result.hit)
                assert b is not None and result.hit <= b <= key[1]


@pytest.mark.parametrize(
    ("kind", "draft_entries", "hit"),
    [
        # 15.2 as written would accept 64: the window of 80 starts at 41, but token 64's
        # window starts at 25 and page 0 of the drafter has no full key.
        ("sliding", [64, 80], 0),
        # 15.2 as written would accept 48 with no draft entry at all (64 starts a chunk).
        ("chunked", [], 0),
        # with the drafter's page 0 keyed, the margin is the only limit again
        ("sliding", [32, 48, 64, 80], 64),
    ],
)
def test_drop_margin_on_window_drafters_requires_x_too(
    kind: str, draft_entries: list[int], hit: int
) -> None:
    """Decision D2 (docs/decisions.md): a sliding/chunked draft group in drop mode accepts x
    iff x + u ≤ n·u and it accepts both x + u and x, so every page the slots at x name is
    proven."""
    extra = {"window": 40} if kind == "sliding" else {"chunk": 64}
    g = geo([G("full", 32), G(kind, 32, role="draft", **extra)], hash_unit=16, spec_mode="drop")
    r = req(seq(100))
    e = published(g, finished(seq(100)), groups=[0]) | {
        (1, b, ident(g, r, b)) for b in draft_entries
    }
    result = oracle(g, r, e)
    assert (result.hit, result.reason) == (hit, "window_limited")


# ----------------------------------------------------------------------------- small worlds
SMALL_GEOS = {
    "full": geo([G("full", 32)], hash_unit=16),
    **{f"sliding B16 W{w}": geo([G("sliding", 16, window=w)]) for w in (2, 17, 20, 33)},
    **{f"sliding B32 W{w}": geo([G("sliding", 32, window=w)], hash_unit=16) for w in (2, 33, 40)},
    **{f"chunked B16 C{c}": geo([G("chunked", 16, chunk=c)]) for c in (16, 32, 48)},
    "chunked B32 C64": geo([G("chunked", 32, chunk=64)], hash_unit=16),
    "drop, sliding draft": geo(
        [G("full", 32), G("sliding", 32, window=33, role="draft")], hash_unit=16, spec_mode="drop"
    ),
    "drop, full draft + recurrent": geo(
        [G("full", 32, role="draft"), G("recurrent", 16)], spec_mode="drop"
    ),
    "drop, chunked draft": geo(
        [G("full", 32), G("chunked", 32, chunk=64, role="draft")], hash_unit=16, spec_mode="drop"
    ),
    "lookahead 2, full + recurrent": geo(
        [G("full", 32), G("recurrent", 16)], spec_mode="lookahead", lookahead_tokens=2
    ),
}


def attended_pages(grp: GroupGeometry, hit: int) -> set[int]:
    """Pages holding a token in [lo, hit), the earlier tokens the next token hit attends to."""
    if grp.kind == "sliding":
        lo = max(0, hit - (grp.window or 0) + 1)
    elif grp.kind == "chunked":
        lo = hit - hit % (grp.chunk or 1)
    else:
        lo = 0
    return {t // grp.page_size for t in range(lo, hit)}


@pytest.mark.parametrize("name", list(SMALL_GEOS))
def test_small_world_exhaustive(name: str) -> None:
    """Every subset of one request's own entries: the oracle equals the fixed point of 7.7 on
    run/hi tables, and the slot markers equal the attended pages."""
    g = SMALL_GEOS[name]
    for length in (57, 81):  # n·u = 48: 48 + u starts a chunk above n·u; n·u = 80
        check_small_world(g, req(seq(length)))


def check_small_world(g: Geometry, r: OracleRequest) -> None:
    keys = universe(g, [r])
    for mask in range(1 << len(keys)):
        entries = {key for i, key in enumerate(keys) if mask >> i & 1}
        result = oracle(g, r, entries)
        groups = [FastGroup(g, r, entries, grp) for grp in g.groups]
        assert fixed_point(result.top, groups) == result.hit, sorted(e[:2] for e in entries)
        for gid, marks in expected_slots(g, r, entries, result.hit).items():
            grp = g.groups[gid]
            needed = attended_pages(grp, result.hit)
            for j, mark in enumerate(marks):
                want = "full" if (j + 1) * grp.page_size <= result.hit else "copy"
                assert mark == (want if j in needed else "null"), (gid, j, marks)
