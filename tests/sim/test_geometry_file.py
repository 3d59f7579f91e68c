"""Geometry TOML files and presets for the simulator."""

from __future__ import annotations

import pytest

from kvreuse import ConfigError
from kvreuse.sim.geometry import PRESETS, GeometryError, load_geometry, preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load(name: str) -> None:
    geo = preset(name)
    assert geo.cache.geometry.groups


def test_hybrid_preset_is_the_issue_geometry() -> None:
    geo = preset("hybrid-dcp4").cache.geometry
    assert [g.page_size for g in geo.groups] == [8192, 256]
    assert geo.hash_unit == 256


def test_scheduler_knobs_and_capacity_tokens() -> None:
    geo = load_geometry("""
        [cache]
        capacity_tokens = 8192
        dcp_size = 4
        max_num_seqs = 7
        max_num_batched_tokens = 512
        max_model_len = 4096
        [[groups]]
        kind = "full"
        block_size = 16
    """)
    assert geo.sched.max_num_seqs == 7 and geo.sched.max_num_batched_tokens == 512
    assert geo.max_model_len == 4096
    assert geo.cache.num_blocks == 1 + 8192 // 64
    assert geo.cache.capacity_tokens() == 8192


@pytest.mark.parametrize(
    ("text", "exc", "fragment"),
    [
        ("[cache\n", GeometryError, "not valid TOML"),
        ("[cache]\nnum_blocks = 8\n", GeometryError, "at least one"),
        (
            '[cache]\nnum_blocks = 8\ncolour = 1\n[[groups]]\nkind = "full"\nblock_size = 16\n',
            GeometryError,
            r"\[cache\] has unknown key\(s\) \['colour'\]",
        ),
        (
            '[cache]\nnum_blocks = 8\n[[groups]]\nkind = "full"\nblock = 16\n',
            GeometryError,
            r"\[\[groups\]\] #0 has unknown key\(s\) \['block'\]",
        ),
        ('[[groups]]\nkind = "full"\nblock_size = 16\n', GeometryError, "needs num_blocks"),
        (
            '[cache]\nnum_blocks = 8\ncapacity_tokens = 64\n[[groups]]\nkind = "full"\n'
            "block_size = 16\n",
            GeometryError,
            "both",
        ),
        (
            '[cache]\nnum_blocks = 8\n[[groups]]\nkind = "sliding"\nblock_size = 16\n',
            ConfigError,
            "window",
        ),
        (
            '[model]\nx = 1\n[[groups]]\nkind = "full"\nblock_size = 16\n',
            GeometryError,
            "unknown table",
        ),
        (
            '[cache]\nnum_blocks = 8\nmax_num_seqs = 0\n[[groups]]\nkind = "full"\n'
            "block_size = 16\n",
            GeometryError,
            "max_num_seqs",
        ),
    ],
)
def test_bad_geometry_files(text: str, exc: type, fragment: str) -> None:
    with pytest.raises(exc, match=fragment):
        load_geometry(text)


def test_unknown_preset() -> None:
    with pytest.raises(GeometryError, match="presets"):
        preset("nope")
