"""Ctrl-C never leaves an earlier run's report beside this run's partial results: `simulate`,
`simulate --replicas` and `sweep` remove what an earlier run wrote to --out as their run starts,
and an interrupted run writes reports that say so (exit 130, one line on stderr)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvreuse.cli import main
from kvreuse.fleet.simulation import run as fleet_sim
from kvreuse.sim import cli as sim_cli
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


def _fleet(workload: Path, out: Path) -> list[str]:
    policies = ["--policy", "exact", "--policy", "round-robin"]
    return ["simulate", "--geometry", "attention-16", str(workload), "--out", str(out),
            "--replicas", "2", *policies, "--quiet"]  # fmt: skip


@pytest.mark.parametrize("stopped", ["exact", "round-robin"])
def test_a_fleet_stopped_mid_way_keeps_no_earlier_report(
    tmp_path: Path,
    earlier: Path,
    now: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    stopped: str,
) -> None:
    out = tmp_path / "o"
    assert main(_fleet(earlier, out)) == 0
    capsys.readouterr()
    real = fleet_sim.simulate_fleet

    def simulate_fleet(dep: Any, workload: Any, options: Any, *rest: Any) -> Any:
        if options.policy == stopped:
            raise KeyboardInterrupt
        return real(dep, workload, options, *rest)

    monkeypatch.setattr(fleet_sim, "simulate_fleet", simulate_fleet)
    assert main(_fleet(now, out)) == 130
    _one_line(capsys, f"kvreuse simulate: interrupted during the {stopped} run")
    doc = json.loads((out / "fleet.json").read_text())
    finished = ["exact"] if stopped == "round-robin" else []
    assert doc["interrupted"] and [r["policy"] for r in doc["runs"]] == finished
    assert all(r["requests"] == 6 for r in doc["runs"])
    assert "(interrupted" in (out / "fleet.md").read_text().splitlines()[0]
    for policy in ("exact", "round-robin"):  # the earlier run's 8 rows are gone
        rows = out / f"fleet-requests-{policy}.jsonl"
        expected = 6 if policy in finished else 0
        assert not rows.exists() or len(rows.read_text().splitlines()) == expected


def test_a_fleet_run_removes_the_rows_of_policies_it_does_not_run(
    tmp_path: Path, earlier: Path, now: Path
) -> None:
    out = tmp_path / "o"
    assert main(_fleet(earlier, out)) == 0
    one = ["simulate", "--geometry", "attention-16", str(now), "--out", str(out), "--replicas",
           "2", "--quiet"]  # fmt: skip
    assert main(one) == 0
    assert not (out / "fleet-requests-round-robin.jsonl").exists()
    assert len((out / "fleet-requests-exact.jsonl").read_text().splitlines()) == 6


def test_a_simulation_stopped_before_its_loop_keeps_no_earlier_report(
    tmp_path: Path,
    earlier: Path,
    now: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "o"
    args = ["--geometry", "attention-16", "--out", str(out), "--quiet"]
    assert main(["simulate", str(earlier), *args]) == 0
    assert (out / "usage_hit_rate.png").exists()
    capsys.readouterr()
    monkeypatch.setattr(sim_cli, "simulate", _interrupt)  # Ctrl-C as the run sets up
    assert main(["simulate", str(now), *args]) == 130
    _one_line(capsys, "kvreuse simulate: interrupted")
    for name in sim_cli.OUTPUTS:  # the earlier run's summary, report and plots are gone
        path = out / name
        assert not path.exists() or path.stat().st_size == 0, name
