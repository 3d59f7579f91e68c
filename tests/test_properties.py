"""Hypothesis property tests of spec §15.3 (T1–T14) against the oracle.

Random geometries (1–3 groups of all four kinds, dcp ∈ {1, 2, 4, 8}, several hash units, all
three spec modes, sparse and dense retention, small pools that force eviction) and random
histories (cold, resend, extension, divergence, multi-turn, several requests per step, chunked
prefill, drafts with random acceptance, unwritten saves, aborts before and after commit,
discards, preemption, targeted eviction, reset). After every operation the driver checks the
invariants, event replay and metric identities; every lookup is compared with the oracle.
"""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from harness import Driver, Engine
from kvreuse import CacheConfig, GroupSpec


@st.composite
def geometries(draw: st.DrawFn) -> CacheConfig:
    base = draw(st.sampled_from([1, 2, 4, 8]))
    dcp = draw(st.sampled_from([1, 2, 4, 8]))
    num_groups = draw(st.integers(1, 3))
    kinds = draw(st.lists(st.sampled_from(["full", "sliding", "chunked", "recurrent"]),
                          min_size=num_groups, max_size=num_groups))
    groups: list[GroupSpec] = []
    for kind in kinds:
        local = base * draw(st.sampled_from([1, 2]))
        sharded = kind == "full" and draw(st.booleans())
        page = local * dcp if sharded else local
        cacheable = kind == "recurrent" or draw(st.integers(0, 9)) > 0
        if kind == "sliding":
            groups.append(GroupSpec(kind="sliding", block_size=local,
                                    window=draw(st.integers(2, 3 * page + 2)),
                                    prefix_cacheable=cacheable))
        elif kind == "chunked":
            groups.append(GroupSpec(kind="chunked", block_size=local,
                                    chunk=page * draw(st.sampled_from([1, 2])),
                                    prefix_cacheable=cacheable))
        elif kind == "recurrent":
            groups.append(GroupSpec(kind="recurrent", block_size=local,
                                    state_scratch_blocks=draw(st.sampled_from([0, 0, 1]))))
        else:
            groups.append(GroupSpec(kind="full", block_size=local, dcp_sharded=sharded,
                                    prefix_cacheable=cacheable))
    mode = draw(st.sampled_from(["none", "none", "lookahead", "drop"]))
    if mode == "drop":
        drafts = [i for i, g in enumerate(groups) if g.kind != "recurrent" and g.prefix_cacheable]
        if drafts:
            i = draw(st.sampled_from(drafts))
            g = groups[i]
            groups[i] = GroupSpec(kind=g.kind, block_size=g.block_size, dcp_sharded=g.dcp_sharded,
                                  window=g.window, chunk=g.chunk, role="draft")
        elif len(groups) < 3:
            groups.append(GroupSpec(kind="full", block_size=base, dcp_sharded=False, role="draft"))
        else:
            mode = "none"
    import math

    local_gcd = math.gcd(*(g.block_size for g in groups))
    unit = draw(st.sampled_from([None, *[d for d in (1, 2, 4) if local_gcd % d == 0]]))
    u = unit or local_gcd
    lookahead = draw(st.integers(1, u)) if mode == "lookahead" else 1
    return CacheConfig(
        num_blocks=draw(st.sampled_from([10, 16, 24, 40, 400])),
        groups=groups,
        dcp_size=dcp,
        hash_unit=unit,
        spec_mode=mode,
        lookahead_tokens=lookahead,
        recurrent_retention=draw(st.sampled_from(["sparse", "dense"])),
        enable_prefix_caching=draw(st.integers(0, 19)) > 0,
        ghost_capacity=draw(st.sampled_from([None, None, 0, 3])),
        admission_watermark_blocks=draw(st.sampled_from([0, 0, 1])),
    )


@given(cfg=geometries(), seed=st.integers(0, 2**32 - 1), rounds=st.integers(1, 30))
def test_random_histories_agree_with_the_oracle(cfg: CacheConfig, seed: int, rounds: int) -> None:
    """T1, T2, T4–T10, T13: every lookup equals the oracle; every operation keeps invariants."""
    drv = Driver(cfg, random.Random(seed))
    page = max(g.page_size for g in cfg.geometry.groups)
    Engine(drv, max_len=min(3 * page + 5, 120)).run(rounds)
