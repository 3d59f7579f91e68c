"""Trace blocks hashed once per block path (`kvreuse.sim.blockchains`): the digests a prompt
takes from earlier requests, followed by what the core hashes from its tokens, are exactly the
chain its tokens give, in any order of arrival; nothing is held once every reader has asked;
and a simulation gives the same rows and summary with and without the memo."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvreuse.core import CacheConfig, GroupSpec, KVCacheManager, Request
from kvreuse.core.hashing.hasher import Hasher
from kvreuse.deployment import preset
from kvreuse.fleet.simulation import run as fleet_run
from kvreuse.fleet.simulation.run import FleetOptions, simulate_fleet
from kvreuse.sim import run as sim_run
from kvreuse.sim.blockchains import BlockChains
from kvreuse.sim.run import simulate
from kvreuse.sim.traces import ImportOptions, import_trace
from kvreuse.sim.workload import load_workload, parse_line, tokens_of

DATA = Path(__file__).parents[1] / "data"


@st.composite
def workloads(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Requests whose block ids extend earlier requests' paths (sharing, diverging, or reusing
    an id under another parent), cut inside a block or followed by a private tail, with and
    without a salt or a LoRA."""
    size = draw(st.integers(1, 12))
    num = draw(st.integers(1, 12))
    paths: list[list[int]] = []
    lines = []
    for i in range(num):
        if paths and draw(st.booleans()):
            base = draw(st.sampled_from(paths))
            ids = base[: draw(st.integers(0, len(base)))]
        else:
            ids = []
        ids = ids + draw(st.lists(st.integers(0, 5), min_size=0 if ids else 1, max_size=5))
        paths.append(ids)
        length = draw(st.integers(1, len(ids) * size))
        prompt: dict[str, Any] = {"blocks": {"ids": ids, "block_tokens": size, "len": length}}
        if length == len(ids) * size and draw(st.booleans()):
            tail = {"random": {"seed": i, "len": draw(st.integers(1, 2 * size))}}
            prompt = {"concat": [prompt, tail]}
        line: dict[str, Any] = {"id": f"q{i}", "prompt": prompt, "max_tokens": 1}
        salt = draw(st.sampled_from([None, None, "tenant"]))
        if salt:
            line["cache_salt"] = salt
        if draw(st.integers(0, 4)) == 0:
            line["lora"] = ["fr", "/fr"]
        lines.append(line)
    return lines


@given(
    lines=workloads(),
    unit=st.integers(1, 8),
    lookahead=st.sampled_from([0, 0, 1, 3]),
    algo=st.sampled_from(["sha256", "sha256_cbor"]),
    order=st.randoms(use_true_random=False),
)
def test_the_memo_gives_each_prompt_the_chain_of_its_tokens(
    lines: list[dict[str, Any]], unit: int, lookahead: int, algo: str, order: random.Random
) -> None:
    hasher = Hasher(algo, unit, 0 if algo == "sha256_cbor" else min(lookahead, unit))
    lookahead = hasher.lookahead
    workload = [parse_line(line, i + 1) for i, line in enumerate(lines)]
    chains = BlockChains(hasher, workload)
    arrival = list(workload)
    order.shuffle(arrival)
    for w in arrival:
        tokens = tokens_of(w.prompt, {})
        prefix = chains.prefix(w, tokens)
        expected = hasher.hash_units(tokens, lora=w.lora, cache_salt=w.cache_salt)
        assert list(prefix) == expected[1 : len(prefix) + 1]
        blocks = w.prompt.get("blocks") or w.prompt["concat"][0]["blocks"]
        complete = blocks["len"] // blocks["block_tokens"] * blocks["block_tokens"]
        assert len(prefix) >= max(0, (complete - lookahead) // unit)
        # the core hashes the rest from the tokens: the whole chain, as from the tokens alone
        chain = hasher.chain(lora=w.lora, cache_salt=w.cache_salt)
        chain.adopt(prefix)
        chain.extend(tokens)
        assert chain.hashes == expected
    assert chains.num_paths == 0 and chains.num_held == 0


def test_each_block_path_is_hashed_once() -> None:
    lines = [
        {
            "id": f"q{i}",
            "prompt": {"blocks": {"ids": ids, "block_tokens": 4, "len": n}},
            "max_tokens": 1,
        }
        for i, (ids, n) in enumerate(
            [([1, 2, 3], 12), ([1, 2, 3], 12), ([1, 2, 4], 10), ([5, 2], 8), ([1], 4)]
        )
    ]
    workload = [parse_line(line, i + 1) for i, line in enumerate(lines)]
    chains = BlockChains(Hasher("sha256", 2), workload)
    for w in workload:
        chains.prefix(w, tokens_of(w.prompt, {}))
    # paths 1, 1-2, 1-2-3, 5, 5-2 (1-2-4 is cut: its last block is hashed from its tokens)
    assert chains.num_hashed_blocks == 5
    assert chains.num_reused_blocks == 3 + 2 + 1


def test_the_core_checks_prefix_hashes_it_is_given() -> None:
    mgr = KVCacheManager(CacheConfig(num_blocks=8, groups=[GroupSpec(kind="full", block_size=4)]))
    tokens = list(range(10))
    chain = mgr.hasher.hash_units(tokens)
    mgr.add_request(Request("a", tokens, prefix_hashes=chain[1:3]))
    assert mgr.requests["a"].chain.hashes == chain
    with pytest.raises(ValueError, match="prefix_hashes holds 3 digests; the prompt has 2"):
        mgr.add_request(Request("b", tokens, prefix_hashes=[*chain[1:], chain[1]]))
    with pytest.raises(TypeError, match="prefix_hashes must be digests"):
        mgr.add_request(Request("c", tokens, prefix_hashes=[b"short"]))
    assert set(mgr.requests) == {"a"}


def test_a_manager_that_checks_prefix_hashes_refuses_wrong_ones_naming_the_unit() -> None:
    """Trusted by default (the first call adopts a wrong digest); checked on request."""
    cfg = CacheConfig(num_blocks=8, groups=[GroupSpec(kind="full", block_size=4)])
    tokens = list(range(12))
    chain = KVCacheManager(cfg).hasher.hash_units(tokens)
    wrong = [chain[1], chain[3], chain[3]]  # unit 2's digest is unit 3's
    trusting = KVCacheManager(cfg)
    trusting.add_request(Request("w", tokens, prefix_hashes=wrong))
    assert trusting.requests["w"].chain.hashes[2] == chain[3]  # taken as given
    mgr = KVCacheManager(cfg, check_prefix_hashes=True)
    mgr.add_request(Request("ok", tokens, prefix_hashes=chain[1:3]))
    assert mgr.requests["ok"].chain.hashes == chain
    with pytest.raises(ValueError, match=r"prefix_hashes\[1\] is not the digest of unit 2 "):
        mgr.add_request(Request("w", tokens, prefix_hashes=wrong))
    salted = Request("s", tokens, prefix_hashes=chain[1:3], cache_salt="tenant")
    with pytest.raises(ValueError, match=r"prefix_hashes\[0\] is not the digest of unit 1 "):
        mgr.add_request(salted)  # a digest of the unsalted chain under another key
    assert set(mgr.requests) == {"ok"}


@pytest.mark.parametrize("name", ["mooncake_synthetic_excerpt", "bailian_schema_excerpt"])
def test_the_digests_the_simulator_hands_out_pass_the_check(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request the simulator gives trace digests to is hashed again from its tokens."""
    adopted: list[int] = []

    class Checking(KVCacheManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs, check_prefix_hashes=True)

        def add_request(self, req: Request) -> None:
            adopted.append(len(req.prefix_hashes))
            super().add_request(req)

    monkeypatch.setattr(sim_run, "KVCacheManager", Checking)
    result = simulate(preset("attention-16"), excerpt(name))
    assert result.summary["requests"] == len(excerpt(name))
    assert sum(adopted) > 0  # digests were handed out, and every one was checked


def excerpt(name: str) -> list[Any]:
    fmt = "bailian" if name.startswith("bailian") else "mooncake"
    text = (DATA / f"{name}.jsonl").read_text().splitlines()
    lines = import_trace(fmt, text, name, ImportOptions())
    return load_workload(json.dumps(x) for x in lines)


def no_memo(hasher: Any, workload: Any) -> None:
    return None


@pytest.mark.parametrize("name", ["mooncake_synthetic_excerpt", "bailian_schema_excerpt"])
@pytest.mark.parametrize("geometry", ["attention-16", "hybrid-dcp4"])
def test_a_simulation_is_the_same_with_and_without_the_memo(
    name: str, geometry: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    workload = excerpt(name)
    dep = preset(geometry)
    dep = replace(dep, cache=replace(dep.cache, num_blocks=dep.cache.num_blocks // 2))
    with_memo = simulate(dep, workload)
    fleet_with = simulate_fleet(dep, workload, FleetOptions(replicas=3))
    monkeypatch.setattr(sim_run, "BlockChains", no_memo)
    monkeypatch.setattr(fleet_run, "BlockChains", no_memo)
    without = simulate(dep, workload)
    assert with_memo.requests == without.requests
    assert with_memo.summary == without.summary
    assert fleet_with == simulate_fleet(dep, workload, FleetOptions(replicas=3))
