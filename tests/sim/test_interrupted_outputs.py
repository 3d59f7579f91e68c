"""Ctrl-C never leaves an earlier run's report beside this run's partial results: `sweep`
removes what an earlier run wrote to --out as its run starts, and an interrupted run writes
reports that say so (exit 130, one line on stderr)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvreuse.cli import main
from kvreuse.sim import sweep
from kvreuse.sim.generators import agent, shared_prefix


def _workload(path: Path, lines: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


@pytest.fixture
def earlier(tmp_path: Path) -> Path:
    """An earlier run's workload: 8 requests (this run's have another count)."""
    return _workload(tmp_path / "earlier.jsonl", shared_prefix(64, 16, 8, max_tokens=1))


@pytest.fixture
def now(tmp_path: Path) -> Path:
    return _workload(tmp_path / "now.jsonl", agent(2, 3, 32, 16, 4))  # 6 requests


def _interrupt(*args: Any, **kwargs: Any) -> Any:
    raise KeyboardInterrupt


def _one_line(capsys: pytest.CaptureFixture[str], start: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(start), err
    return err


def test_a_sweep_stopped_before_its_first_case_keeps_no_earlier_report(
    tmp_path: Path,
    earlier: Path,
    now: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "o"
    args = ["--geometry", "attention-16", "--capacity", "20K", "--out", str(out), "--quiet"]
    assert main(["sweep", str(earlier), *args]) == 0  # with its plots
    assert (out / "prefill_time.png").exists()
    capsys.readouterr()
    monkeypatch.setattr(sweep, "run_case", _interrupt)
    assert main(["sweep", str(now), "--jobs", "1", *args]) == 130
    _one_line(capsys, "kvreuse sweep: interrupted after 0 of 1 cases")
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["workload"] == str(now) and doc["interrupted"] and doc["cases"] == []
    report = (out / "sweep.md").read_text()
    assert report.startswith(f"# Sweep of {now}\n") and "**Interrupted**" in report
    assert "attention-16" not in report  # no row: no case finished
    assert not list(out.glob("*.png"))
