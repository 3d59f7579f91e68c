"""Property depth scaled with the active Hypothesis profile (tests/conftest.py): `ci`, the
default, runs 500 examples per property; a property that drives a whole server or replays a long
history declares the share of that it runs (`scaled(150)`: 150 at `ci`), so that `slow` (5,000)
runs it ten times deeper and `dev` (50) ten times shallower, instead of a count no profile moves."""

from __future__ import annotations

from hypothesis import settings

CI_EXAMPLES = 500  # the `ci` profile's depth, which the counts below are written at


def scaled(n: int) -> int:
    """`n` examples at `ci` depth, scaled to the active profile."""
    return max(1, round(n * settings().max_examples / CI_EXAMPLES))
