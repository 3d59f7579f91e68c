"""Hypothesis profiles: `ci` (default, 500 examples per property), `slow` (5,000) and `dev`
(50); a property that declares a smaller share at `ci` depth scales with the profile too
(tests/depth.py).

Tests are grouped by what they need: `core/` only the core (and the test extra), `sim/` the
simulator's plotting and progress packages, `engine/` torch, `serve/` the server stack. A folder
whose packages are missing is skipped as a whole, naming the extra to install.

What a test needs beyond the main venv (another venv, a Redis server, the native build) is
marked `@pytest.mark.needs(ok, what, how)`: without it the test is skipped on a developer's
machine, naming `how` to get it, and fails under CI (`CI` set), where `.ci/run` provides all of
them, so that a build that broke never passes as a skip.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

from needs import missing

settings.register_profile(
    "ci", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "slow", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("KVREUSE_HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs(ok, what, how): skip without it (naming how to get it); fail under CI"
    )
    config.addinivalue_line(
        "markers", "lint: checks the source tree, not a code path (a second pass deselects it)"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        ok, what, how = mark.args
        if not ok:
            missing(what, how)
