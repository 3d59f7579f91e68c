"""Deployments: geometry TOML files, presets, `resolve` and the TOML a server serves."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvreuse import ConfigError
from kvreuse.deployment import (
    PRESETS,
    GeometryError,
    geometry_toml,
    load_geometry,
    preset,
    resolve,
)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load(name: str) -> None:
    dep = preset(name)
    assert dep.cache.geometry.groups


def test_hybrid_preset_is_the_dcp4_hybrid() -> None:
    geo = preset("hybrid-dcp4").cache.geometry
    assert [g.page_size for g in geo.groups] == [8192, 256]
    assert geo.hash_unit == 256


def test_scheduler_knobs_and_capacity_tokens() -> None:
    dep = load_geometry("""
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
    assert dep.sched.max_num_seqs == 7 and dep.sched.max_num_batched_tokens == 512
    assert dep.max_model_len == 4096
    assert dep.cache.num_blocks == 1 + 8192 // 64
    assert dep.cache.capacity_tokens() == 8192


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


def test_resolve_takes_a_preset_a_file_or_a_deployment(tmp_path: Path) -> None:
    dep = resolve("hybrid-dcp4")
    assert dep == preset("hybrid-dcp4") and resolve(dep) is dep
    path = tmp_path / "geo.toml"
    path.write_text(PRESETS["attention-16"])
    for spec in (path, str(path)):
        got = resolve(spec)
        assert got.name == str(path) and got.cache == preset("attention-16").cache


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("nope", "give a preset (attention-16, "),
        ("missing/geo.toml", "cannot read the geometry file"),
        (42, "a deployment is a preset name, a path to a .toml geometry file, or a Deployment"),
    ],
)
def test_resolve_names_what_is_allowed(spec: Any, fragment: str) -> None:
    with pytest.raises(GeometryError, match=re.escape(fragment)) as info:
        resolve(spec)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_geometry_toml_reads_back_equal(name: str) -> None:
    dep = preset(name)
    back = load_geometry(geometry_toml(dep), "served")
    assert (back.cache, back.sched, back.max_model_len) == (dep.cache, dep.sched, dep.max_model_len)


FULL = '[[groups]]\nkind = "full"\nblock_size = 16\n'


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("cache = 5\n" + FULL, r"g\.toml: cache must be a table"),
        ("groups = [1, 2]\n[cache]\nnum_blocks = 8\n", r"\[\[groups\]\] #0 must be a table"),
        ('[cache]\nnum_blocks = 8\ngroups = {kind = "full"}\n', r"unknown key\(s\) \['groups'\]"),
        ('[cache]\nnum_blocks = 8\nmax_model_len = "x"\n' + FULL, "max_model_len must be an int"),
        ("[cache]\nnum_blocks = 8\nmax_model_len = 0\n" + FULL, "max_model_len must be ≥ 1"),
        ("[cache]\nnum_blocks = 9223372036854775808\n" + FULL, "outside TOML's 64-bit"),
        ("[cache]\nnum_blocks = 8\nhash_unit = 2.5\n" + FULL, "hash_unit must be an integer"),
        (
            "[cache]\nnum_blocks = 1000000000\n" + FULL,
            r"num_blocks = 1,000,000,000 is too large: .* about 177\.0 GB",
        ),
        (
            "[cache]\ncapacity_tokens = 9223372036854775807\n" + FULL,
            r"\(for capacity_tokens = 9,223,372,036,854,775,807\) is too large",
        ),
        (
            '[cache]\nnum_blocks = 8\nenable_prefix_caching = "no"\n' + FULL,
            "enable_prefix_caching must be true or false, got 'no'",
        ),
        (
            '[cache]\nnum_blocks = 8\ndefer_shared_prefix = "false"\n' + FULL,
            "defer_shared_prefix must be true or false",
        ),
        (
            '[cache]\nnum_blocks = 8\n[[groups]]\nkind = "full"\nblock_size = 16\n'
            'dcp_sharded = "yes"\n',
            r"\[\[groups\]\] #0 dcp_sharded must be true or false",
        ),
        (
            '[cache]\nnum_blocks = 8\n[[groups]]\nkind = "full"\nblock_size = "16"\n',
            "block_size must be an integer",
        ),
        ("[cache]\nnum_blocks = 8\n[[groups]]\nblock_size = 16\n", r"missing \['kind'\]"),
        (
            "[cache]\nnum_blocks = 8\nnum_spec_tokens = 4\nmax_num_batched_tokens = 4\n" + FULL,
            r"1 \+ num_spec_tokens = 5 tokens, more than max_num_batched_tokens = 4",
        ),
        (
            "[cache]\nnum_blok = 8\n" + FULL,
            r"unknown key\(s\) \['num_blok'\] \('num_blok': did you mean 'num_blocks'\?\); "
            r"allowed: \['admission_watermark_blocks'",
        ),
        (
            "[cache]\nnum_blocks = 8\n[[groups]]\nkind = 'full'\nblock_sise = 16\n",
            r"did you mean 'block_size'\?",
        ),
    ],
)
def test_bad_values_are_one_clear_error_naming_the_file(text: str, fragment: str) -> None:
    with pytest.raises(GeometryError, match=fragment) as info:
        load_geometry(text, "g.toml")
    assert str(info.value).startswith("g.toml: ") and "\n" not in str(info.value)


def test_the_core_s_errors_name_the_file_too(tmp_path: Path) -> None:
    path = tmp_path / "geo.toml"
    path.write_text('[cache]\nnum_blocks = 8\n[[groups]]\nkind = "sliding"\nblock_size = 16\n')
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: group 0 \(sliding\)"):
        resolve(path)


def test_tiny_presets_admit_the_default_resend_grid_and_the_spec_ones_speculate() -> None:
    """The default grid's longest request is 8,193 + 8 prompt tokens and one output (that it
    also fits each cache is tests/sim/test_simulate.py's)."""
    for name in PRESETS:
        if name.startswith("tiny-"):
            dep = preset(name)
            assert dep.max_model_len is not None and dep.max_model_len >= 8193 + 8 + 1, name
    for name in ("tiny-spec-lookahead", "tiny-spec-drop"):
        assert preset(name).sched.num_spec_tokens == 3
