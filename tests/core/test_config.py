"""Configuration (spec §4): validation V1–V7, derived geometry, sizing helpers."""

from __future__ import annotations

import pytest

from kvreuse import CacheConfig, ConfigError, GroupSpec

FULL16 = GroupSpec(kind="full", block_size=16)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_blocks": 1, "groups": [FULL16]}, "num_blocks must be ≥ 2"),
        ({"num_blocks": 8, "groups": []}, "groups is empty"),
        ({"num_blocks": 8, "groups": [GroupSpec(kind="full", block_size=0)]}, "block_size"),
        ({"num_blocks": 8, "groups": [FULL16], "dcp_size": 0}, "dcp_size"),
        ({"num_blocks": 8, "groups": [FULL16], "admission_watermark_blocks": -1}, "watermark"),
        ({"num_blocks": 8, "groups": [FULL16], "ghost_capacity": -1}, "ghost_capacity"),
        ({"num_blocks": 8, "groups": [FULL16], "max_pending_events": -1}, "max_pending_events"),
        ({"num_blocks": 8, "groups": [FULL16], "finished_stats_capacity": -5}, "finished_stats"),
        ({"num_blocks": 8, "groups": [FULL16], "eviction_policy": "fifo"}, "eviction_policy"),
        (  # V2
            {
                "num_blocks": 8,
                "dcp_size": 4,
                "groups": [GroupSpec(kind="sliding", block_size=16, window=64, dcp_sharded=True)],
            },
            "must be replicated",
        ),
        (  # V3
            {"num_blocks": 8, "groups": [GroupSpec(kind="sliding", block_size=16, window=1)]},
            "window ≥ 2",
        ),
        (
            {"num_blocks": 8, "groups": [GroupSpec(kind="chunked", block_size=16, chunk=24)]},
            "positive multiple of its page of 16",
        ),
        ({"num_blocks": 8, "groups": [GroupSpec(kind="full", block_size=16, window=8)]}, "window"),
        (
            {"num_blocks": 8, "groups": [GroupSpec(kind="full", block_size=16, chunk=16)]},
            "chunk applies only",
        ),
        (
            {
                "num_blocks": 8,
                "groups": [GroupSpec(kind="full", block_size=16, state_scratch_blocks=1)],
            },
            "state_scratch_blocks",
        ),
        ({"num_blocks": 8, "groups": [FULL16], "hash_unit": 0}, "hash_unit must be ≥ 1"),
        (  # V5
            {"num_blocks": 8, "groups": [FULL16], "spec_mode": "lookahead", "lookahead_tokens": 17},
            "exceeds hash_unit 16",
        ),
        (
            {"num_blocks": 8, "groups": [FULL16], "spec_mode": "lookahead", "lookahead_tokens": 0},
            "lookahead_tokens",
        ),
        ({"num_blocks": 8, "groups": [FULL16], "spec_mode": "drop"}, "role 'draft'"),
        (
            {"num_blocks": 8, "groups": [GroupSpec(kind="recurrent", block_size=16, role="draft")]},
            "must be a target",
        ),
        (  # V6
            {
                "num_blocks": 8,
                "groups": [GroupSpec(kind="recurrent", block_size=16, prefix_cacheable=False)],
            },
            "enable_prefix_caching=False",
        ),
        ({"num_blocks": 8, "groups": [GroupSpec(kind="mamba", block_size=16)]}, "unknown kind"),
        ({"num_blocks": 8, "groups": [FULL16], "spec_mode": "eagle"}, "spec_mode"),
        ({"num_blocks": 8, "groups": [FULL16], "hash_algo": "md5"}, "hash_algo"),
        ({"num_blocks": 8, "groups": [FULL16], "recurrent_retention": "all"}, "retention"),
    ],
)
def test_invalid_configs_raise_config_error(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        CacheConfig(**kwargs)


def test_v4_message_lists_the_valid_units() -> None:
    with pytest.raises(ConfigError) as err:
        CacheConfig(num_blocks=8, dcp_size=4, hash_unit=24, groups=[FULL16])
    msg = str(err.value)
    assert "hash_unit 24 does not divide the page of group 0 (full, 16 × dcp 4 = 64 tokens)" in msg
    assert "valid values divide 64: 1, 2, 4, 8, 16, 32, 64." in msg


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize(
    ("groups", "dcp", "unit", "pages", "u", "lcm"),
    [
        ([FULL16], 4, None, [64], 16, 64),  # Geo-P: u is the gcd of LOCAL sizes
        (
            [GroupSpec(kind="full", block_size=2048), GroupSpec(kind="recurrent", block_size=256)],
            4,
            None,
            [8192, 256],
            256,
            8192,
        ),  # Geo-L
        (
            [
                FULL16,
                GroupSpec(kind="sliding", block_size=32, window=48),
                GroupSpec(kind="recurrent", block_size=32),
            ],
            4,
            None,
            [64, 32, 32],
            16,
            64,
        ),  # Geo-3
        (
            [GroupSpec(kind="full", block_size=48), GroupSpec(kind="full", block_size=32)],
            1,
            None,
            [48, 32],
            16,
            96,
        ),
        ([FULL16], 1, 4, [16], 4, 16),
    ],
)
def test_geometry_is_resolved(groups, dcp, unit, pages, u, lcm) -> None:
    geo = CacheConfig(num_blocks=8, groups=groups, dcp_size=dcp, hash_unit=unit).geometry
    assert [g.page_size for g in geo.groups] == pages
    assert geo.hash_unit == u
    assert geo.common_page == lcm


def test_non_cacheable_groups_do_not_set_the_unit() -> None:
    cfg = CacheConfig(
        num_blocks=8,
        groups=[
            GroupSpec(kind="full", block_size=16),
            GroupSpec(kind="sliding", block_size=24, window=8, prefix_cacheable=False),
        ],
    )
    assert cfg.geometry.hash_unit == 16  # 24 is not cacheable, so it is not in the gcd


def test_kappa_and_lookahead() -> None:
    draft = GroupSpec(kind="full", block_size=64, role="draft", dcp_sharded=False)
    assert CacheConfig(num_blocks=8, groups=[FULL16]).geometry.kappa == 0
    la1 = CacheConfig(num_blocks=8, groups=[FULL16], spec_mode="lookahead")
    assert (la1.geometry.lookahead, la1.geometry.kappa) == (1, 0)
    la2 = CacheConfig(num_blocks=8, groups=[FULL16], spec_mode="lookahead", lookahead_tokens=2)
    assert (la2.geometry.lookahead, la2.geometry.kappa) == (2, 1)
    drop = CacheConfig(num_blocks=8, groups=[FULL16, draft], spec_mode="drop", dcp_size=4)
    assert (drop.geometry.lookahead, drop.geometry.kappa) == (0, 1)
    # L only counts in lookahead mode.
    none = CacheConfig(num_blocks=8, groups=[FULL16], lookahead_tokens=5)
    assert none.geometry.lookahead == 0


def test_ghost_capacity_default() -> None:
    cfg = CacheConfig(num_blocks=11, dcp_size=4, groups=[FULL16])
    assert cfg.geometry.ghost_capacity == 2 * 10 * 4  # K_max = 64 / 16
    rec_only = CacheConfig(num_blocks=11, groups=[GroupSpec(kind="recurrent", block_size=16)])
    assert rec_only.geometry.ghost_capacity == 2 * 10 * 1


def test_sizing_helpers() -> None:
    assert CacheConfig.num_blocks_for_budget(1000, 100) == 10
    with pytest.raises(ConfigError, match="at least 2"):
        CacheConfig.num_blocks_for_budget(150, 100)
    cfg = CacheConfig(
        num_blocks=101,
        dcp_size=4,
        groups=[FULL16, GroupSpec(kind="recurrent", block_size=16, state_scratch_blocks=1)],
    )
    # full: ⌈(t + s)/64⌉; recurrent: 2 + scratch + κ
    assert cfg.blocks_for_request(0) == 3
    assert cfg.blocks_for_request(64) == 1 + 3
    assert cfg.blocks_for_request(65) == 2 + 3
    assert cfg.blocks_for_request(64, num_extra_slots=1) == 2 + 3
    t = cfg.capacity_tokens()
    assert cfg.blocks_for_request(t) <= 100 < cfg.blocks_for_request(t + 1)
    assert t == 97 * 64
    t4 = cfg.capacity_tokens(concurrent_requests=4)
    assert 4 * cfg.blocks_for_request(t4) <= 100 < 4 * cfg.blocks_for_request(t4 + 1)
    assert cfg.capacity_tokens(num_blocks=3) == 0
    with pytest.raises(ValueError, match="num_tokens"):
        cfg.blocks_for_request(-1)


def test_hash_unit_default_without_cacheable_groups() -> None:
    cfg = CacheConfig(
        num_blocks=8, groups=[GroupSpec(kind="full", block_size=12, prefix_cacheable=False)]
    )
    assert cfg.geometry.hash_unit == 12
    assert not cfg.geometry.caching_enabled


def test_capacity_tokens_without_an_attention_group_is_unbounded() -> None:
    """A recurrent-only geometry holds the same blocks at every length: no largest t exists
    (the search used to double forever); None says so, and 0 still means nothing fits."""
    rec = [GroupSpec(kind="recurrent", block_size=16, state_scratch_blocks=1)]
    cfg = CacheConfig(num_blocks=8, groups=rec)
    assert cfg.capacity_tokens() is None
    assert cfg.blocks_for_request(10**12) == cfg.blocks_for_request(0) == 3
    assert cfg.capacity_tokens(concurrent_requests=3) == 0  # 3 × 3 blocks > 7
    assert CacheConfig(num_blocks=3, groups=rec).capacity_tokens() == 0
