"""A long run says how far it is even when stderr is a log or a pipe: a plain line every
interval once a phase has run that long, none for a short one, none with --quiet."""

from __future__ import annotations

import pytest

from kvreuse.sim.progress import Progress


def test_plain_lines_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    now = [100.0]
    progress = Progress(True, "kvreuse simulate", interval=30, clock=lambda: now[0])
    assert not progress.bars  # pytest's stderr is no terminal
    with progress.phase("exact", 3_993, "req") as report:
        assert report is not None
        for done, t in ((10, 110.0), (900, 131.0), (950, 140.0), (2_000, 161.5)):
            now[0] = t
            report(done, 3_993)
    assert capsys.readouterr().err.splitlines() == [
        "kvreuse simulate: exact: 900 of 3,993 req (31 s)",
        "kvreuse simulate: exact: 2,000 of 3,993 req (62 s)",
    ]


def test_a_short_or_quiet_run_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    now = [0.0]
    with Progress(True, clock=lambda: now[0]).phase("simulating", 10, "req") as report:
        assert report is not None
        report(10, 10)
    with Progress(False).phase("simulating", 10, "req") as report:
        assert report is None
    assert capsys.readouterr().err == ""
