"""`kvreuse simulate --replicas N --policy P …`, through a parser built as `kvreuse simulate`'s
(its own options, then `add_fleet_arguments`): outputs, the comparison table, exit codes and
one-line errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvreuse.fleet.simulation.cli import add_fleet_arguments, fleet_requested, run_fleet
from kvreuse.sim.cli import add_parser
from kvreuse.sim.generators import agent


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvreuse")
    sub = parser.add_subparsers()
    add_parser(sub)
    add_fleet_arguments(sub.choices["simulate"])
    return parser.parse_args(["simulate", *argv])


@pytest.fixture
def workload(tmp_path: Path) -> Path:
    path = tmp_path / "agent.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in agent(4, 3, 64, 32, 8)))
    return path


def test_several_policies_one_table_and_every_output(
    workload: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    fleet = ["--replicas", "2", "--policy", "round-robin", "--policy", "exact"]
    args = parse([str(workload), "--geometry", "tiny-hybrid-dcp4", "--out", str(out), *fleet])
    assert fleet_requested(args)
    assert run_fleet(args) == 0
    printed = capsys.readouterr().out
    header = printed.splitlines()[1].split()
    assert header[:3] == ["policy", "hit", "rate"]
    rows = {line.split()[0] for line in printed.splitlines()[2:4]}
    assert rows == {"round-robin", "exact"}
    doc = json.loads((out / "fleet.json").read_text())
    assert [run["policy"] for run in doc["runs"]] == ["round-robin", "exact"]
    assert all(run["reconciled"] for run in doc["runs"])
    for policy in ("round-robin", "exact"):
        lines = (out / f"fleet-requests-{policy}.jsonl").read_text().splitlines()
        assert len(lines) == 12
        assert {json.loads(line)["replica"] for line in lines} <= {"r0", "r1"}
    assert "round-robin" in (out / "fleet.md").read_text()


def test_without_fleet_options_the_single_simulator_runs(workload: Path, tmp_path: Path) -> None:
    args = parse([str(workload), "--geometry", "tiny-hybrid-dcp4", "--out", str(tmp_path)])
    assert not fleet_requested(args)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy", "exact"], "--policy needs --replicas N"),
        (
            ["--replicas", "2", "--shared-tier-capacity", "1000"],
            "--shared-tier-capacity is gone: --store-capacity TOKENS gives the replicas one store",
        ),
        (["--replicas", "2", "--num-blocks", "3"], "exceed a replica's cache"),
    ],
)
def test_bad_fleet_runs_are_one_line(
    workload: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    args = parse(
        [str(workload), "--geometry", "tiny-hybrid-dcp4", "--out", str(tmp_path / "o"), *extra]
    )
    code = run_fleet(args)
    err = capsys.readouterr().err
    assert code == (1 if "exceed" in message else 2)
    lines = err.strip().splitlines()
    if "exceed" in message:  # a pool the user chose: said before the run, which goes on
        assert "12 of 12 requests can never fit tiny-hybrid-dcp4's pool" in lines.pop(0)
    assert len(lines) == 1 and lines[0].startswith("kvreuse simulate: ")
    assert message in err


def test_a_missing_workload_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(
        ["nope.jsonl", "--geometry", "attention-16", "--out", str(tmp_path), "--replicas", "2"]
    )
    assert run_fleet(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvreuse simulate: nope.jsonl: cannot read the workload file")


@pytest.mark.parametrize(
    "bad", [["--replicas", "0"], ["--policy", "best"], ["--load-weight", "-1"]]
)
def test_bad_option_values_are_usage_errors(bad: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["w.jsonl", "--geometry", "attention-16", "--out", "o", *bad])
    assert exc.value.code == 2


def test_without_the_events_extra_a_fleet_names_it(workload: Path, tmp_path: Path) -> None:
    """The options are offered without msgspec (the mirrors' wire structs); running a fleet
    says which extra to install."""
    code = (
        "import sys; sys.modules['msgspec'] = None\n"
        "from tests_fleet_cli_entry import main\n"
        "raise SystemExit(main())\n"
    )
    entry = tmp_path / "tests_fleet_cli_entry.py"
    entry.write_text(
        "import argparse\n"
        "from kvreuse.fleet.simulation.cli import add_fleet_arguments, run_fleet\n"
        "from kvreuse.sim.cli import add_parser\n"
        "def main():\n"
        "    p = argparse.ArgumentParser(); sub = p.add_subparsers(); add_parser(sub)\n"
        "    add_fleet_arguments(sub.choices['simulate'])\n"
        f"    a = p.parse_args(['simulate', {str(workload)!r}, '--geometry', 'attention-16',\n"
        f"                      '--out', {str(tmp_path / 'o')!r}, '--replicas', '2'])\n"
        "    return run_fleet(a)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "kvreuse simulate: a fleet needs msgspec, which is not installed: "
        "pip install -e '.[events]'"
    ]
