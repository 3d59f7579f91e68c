"""What a test needs beyond the main venv (another venv, a Redis server, the native build):
without it a test is skipped on a developer's machine, naming how to get it, and fails under CI
(`CI` set), where `.ci/run` provides all of it, so that a build that broke never passes as a
skip. Tests call `missing`, or carry `@pytest.mark.needs(ok, what, how)` (tests/conftest.py)."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

UNDER_CI = bool(os.environ.get("CI"))


def missing(what: str, how: str) -> NoReturn:
    """`what` is absent: skip, naming `how` to get it; under CI, fail."""
    if UNDER_CI:
        pytest.fail(f"{what} is absent under CI, which must provide it ({how})", pytrace=False)
    pytest.skip(f"{what} is absent: {how}")
