"""Spec cases on configuration: the named geometries of §4 and the errors of §16 case 36.

* §4: page sizes after DCP scaling and the default hash unit of Geo-P, Geo-H, Geo-D and Geo-L.
* §16 case 36 (§4 validation V2–V6): each rejected configuration raises `ConfigError` with a
  message naming the group, its numbers and the fix; V4's message exactly as the spec prints it.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvreuse.core import CacheConfig, ConfigError
from spec_harness import G, geo_d, geo_h, geo_l, geo_p


# ============================================================================== §4 named geometries
def test_example_geometries_resolve_as_in_section_4() -> None:
    """The table of §4: page sizes after DCP scaling and the default hash unit."""
    cases = [
        (geo_p(), [64], 16),
        (geo_h(), [64, 16], 16),
        (geo_d(), [64, 16, 64], 16),
        (geo_l(), [8192, 256], 256),
    ]
    for cfg, pages, u in cases:
        geo = cfg.geometry
        assert [g.page_size for g in geo.groups] == pages
        assert geo.hash_unit == u


# ====================================================================================== §16 case 36
@pytest.mark.parametrize(
    ("build", "needles"),
    [
        pytest.param(
            lambda: geo_p(hash_unit=24),
            [
                "hash_unit 24",
                "group 0",
                "64",
                "1, 2, 4, 8, 16, 32, 64",
            ],
            id="V4-hash-unit-24",
        ),
        pytest.param(
            lambda: CacheConfig(
                num_blocks=64,
                dcp_size=4,
                groups=[G("full", 16), G("sliding", 32, window=48, dcp_sharded=True)],
            ),
            ["group 1", "sliding", "replicated"],
            id="V2-sharded-sliding",
        ),
        pytest.param(lambda: geo_h(spec_mode="drop"), ["drop", "draft"], id="V5-drop-no-draft"),
        pytest.param(
            lambda: CacheConfig(num_blocks=64, groups=[G("sliding", 32, window=1)]),
            ["group 0", "sliding", "window"],
            id="V3-window-1",
        ),
        pytest.param(
            lambda: CacheConfig(
                num_blocks=64,
                dcp_size=4,
                groups=[G("full", 16), G("recurrent", 16, prefix_cacheable=False)],
            ),
            ["group 1", "recurrent", "enable_prefix_caching=False"],
            id="V6-recurrent-not-cacheable",
        ),
    ],
)
def test_case36_configuration_errors(build: Callable[[], CacheConfig], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_case36_v4_message_exact() -> None:
    with pytest.raises(ConfigError) as info:
        geo_p(hash_unit=24)
    assert str(info.value) == (
        "hash_unit 24 does not divide the page of group 0 (full, 16 × dcp 4 = 64 tokens). "
        "Every page must be a multiple of hash_unit; valid values divide 64: "
        "1, 2, 4, 8, 16, 32, 64."
    )
