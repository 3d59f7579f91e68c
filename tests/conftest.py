"""Hypothesis profiles: `ci` (default, ≥ 500 examples per property) and `slow`.

Tests are grouped by what they need: `core/` only the core (and the test extra), `sim/` the
simulator's plotting and progress packages, `engine/` torch, `serve/` the server stack. A folder
whose packages are missing is skipped as a whole, naming the extra to install.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "slow", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("KVREUSE_HYPOTHESIS_PROFILE", "ci"))
