"""A group kind defined here, not under src/, plugs in through the registry alone.

`EveryOtherUnit` is a toy attention kind: the token at x attends back to the start of the page
before its own, and a hit is accepted only at an even number of units. It declares its layout
(paged), its stage (a window: bound A3), its window arithmetic and its acceptance, fast (a
probe) and plain (for the oracle); nothing else of the core is told about it. Random histories
then run through lookup, allocation, commit (with its window frees), eviction and reset, with
every lookup compared with the oracle and `check_invariants()` after every operation.
"""

from __future__ import annotations

import random
from collections.abc import Container, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import Driver, Engine, Known
from kvreuse import CacheConfig, GroupSpec, KVCacheManager, LookupResult, Request
from kvreuse.core import ConfigError
from kvreuse.core.kinds import KINDS, WindowProbe
from kvreuse.core.spi import PagedGroup, PlainAsk, Probe, Stage, register_kind, unregister_kind

TOY = "every-other-unit"


@dataclass(frozen=True, slots=True, kw_only=True)
class EveryOtherUnit(PagedGroup):
    kind = TOY
    stage = Stage.WINDOW
    frees_pages = True
    wire_kind = "every_other_unit"

    def attend_from(self, x: int) -> int:
        return max(0, (x // self.page_size - 1) * self.page_size)

    def reach(self) -> int:
        return 2 * self.page_size

    def probe(self, keys: Container[bytes], hashes: list[bytes], u: int, nu: int) -> Probe:
        return EvenUnitsProbe(self, keys, hashes, u, nu)

    def accepts_plain(self, ask: PlainAsk, x: int) -> bool:
        return x // ask.u % 2 == 0 and ask.covered(x, self.attend_from(x))


class EvenUnitsProbe(WindowProbe):
    __slots__ = ()

    def ok(self, x: int) -> bool:
        return x // self.u % 2 == 0 and super().ok(x)


@pytest.fixture(autouse=True)
def toy_kind() -> Iterator[None]:
    register_kind(EveryOtherUnit)
    try:
        yield
    finally:
        unregister_kind(TOY)
    assert TOY not in KINDS


class CountingDriver(Driver):
    """The harness's driver (oracle comparison at every lookup), also counting what the toy
    rule decided, so that a history where it never mattered is visible."""

    hits: list[int]

    def lookup(self, k: Known) -> LookupResult:
        res = super().lookup(k)
        self.hits = getattr(self, "hits", [])
        self.hits.append(res.hit)
        return res


@st.composite
def toy_geometries(draw: st.DrawFn) -> CacheConfig:
    u = draw(st.sampled_from([1, 2, 4]))
    page = u * draw(st.sampled_from([1, 2, 4]))
    groups = [GroupSpec(kind=TOY, block_size=page)]
    others = draw(st.sampled_from(["full", "full+recurrent", "recurrent", "sliding", "none"]))
    if "full" in others:
        groups.insert(0, GroupSpec(kind="full", block_size=u * draw(st.sampled_from([1, 2]))))
    if "recurrent" in others:
        groups.append(GroupSpec(kind="recurrent", block_size=page))
    if others == "sliding":
        groups.append(GroupSpec(kind="sliding", block_size=u, window=draw(st.integers(2, 9))))
    return CacheConfig(
        num_blocks=draw(st.sampled_from([12, 20, 40, 400])),
        groups=groups,
        hash_unit=u,
        dcp_size=draw(st.sampled_from([1, 2])),
        ghost_capacity=draw(st.sampled_from([None, 0])),
    )


@given(cfg=toy_geometries(), seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 30))
def test_a_test_kind_runs_through_the_core_against_the_oracle(
    cfg: CacheConfig, seed: int, rounds: int
) -> None:
    drv = CountingDriver(cfg, random.Random(seed))
    page = max(g.page_size for g in cfg.geometry.groups)
    Engine(drv, max_len=min(3 * page + 5, 120)).run(rounds)
    u = cfg.geometry.hash_unit
    assert all(h // u % 2 == 0 for h in getattr(drv, "hits", [])), "the toy's rule was ignored"


def test_the_toy_rule_decides_hits_and_frees_pages() -> None:
    """One history by hand: the toy limits a resend to an even number of units, and a commit
    frees the pages no later token attends to."""
    cfg = CacheConfig(num_blocks=64, groups=[GroupSpec(kind=TOY, block_size=4)], hash_unit=4)
    mgr = KVCacheManager(cfg)
    prompt = list(range(1, 15))  # 14 tokens: top = 12 = 3 units, odd
    mgr.add_request(Request("a", prompt))
    res = mgr.lookup("a")
    assert mgr.allocate("a", len(prompt), res) is not None
    mgr.commit(mgr.seal_step().step_id, {"a": (14, [99])})
    mgr.check_invariants()
    grown = mgr.allocate("a", 1)
    assert grown is not None
    table = grown.tables[0]
    assert table[:2] == [0, 0] and all(table[2:])  # pages 0, 1 left the window of token 14
    mgr.commit(mgr.seal_step().step_id, {"a": (15, [98])})
    mgr.finish("a")
    mgr.add_request(Request("b", prompt))
    res = mgr.lookup("b")
    assert (res.hit, res.top) == (8, 12)  # 12 would be 3 units: the toy accepts 2
    assert res.reason == "window_limited"
    mgr.check_invariants()


def test_the_registry_names_what_it_knows() -> None:
    known = f"allowed kinds: full, sliding, chunked, recurrent, {TOY}"
    with pytest.raises(ConfigError, match=known):
        CacheConfig(num_blocks=8, groups=[GroupSpec(kind="nope", block_size=4)])
    with pytest.raises(ValueError, match="already registered"):

        @dataclass(frozen=True, slots=True, kw_only=True)
        class Other(EveryOtherUnit):
            pass

        register_kind(Other)
    with pytest.raises(ValueError, match="built in"):
        unregister_kind("full")
    with pytest.raises(ConfigError, match="window applies only to sliding groups"):
        CacheConfig(num_blocks=8, groups=[GroupSpec(kind=TOY, block_size=4, window=8)])
    with pytest.raises(ConfigError, match=f"{TOY} groups must be replicated"):
        CacheConfig(num_blocks=8, groups=[GroupSpec(kind=TOY, block_size=4, dcp_sharded=True)])


def test_an_unregistered_kind_is_refused_in_one_line() -> None:
    unregister_kind(TOY)
    try:
        with pytest.raises(ConfigError, match=f"unknown kind '{TOY}'"):
            CacheConfig(num_blocks=8, groups=[GroupSpec(kind=TOY, block_size=4)])
    finally:
        register_kind(EveryOtherUnit)
