"""benchmarks/router_bench.py times the router's decision beside Dynamo's KV indexer (in the mocker
venv) on one recorded event stream; both must find the same best match for every query, which is
what makes the two timings comparable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "router_bench.py"
MOCKER_PYTHON = ROOT / ".venv-mocker" / "bin" / "python"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.needs(
    MOCKER_PYTHON.exists(), "Dynamo's mocker venv", "bash benchmarks/mocker/setup_venv.sh"
)
def test_both_sides_find_the_same_best_match_on_the_same_stream() -> None:
    proc = _bench("--replicas", "1,3", "--waves", "12", "--blocks", "256", "--rounds", "2")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["replicas"] for r in rows] == [1, 3]
    for r in rows:
        assert r["queries"] == 96 and r["same_best_match"] == 96, r
        assert 0 < r["hits_seen"] < 96  # shared prefixes hit, the first of each does not
        assert len(r["kvreuse_us"]["rounds"]) == len(r["dynamo_us"]["rounds"]) == 2
        ours, theirs = r["kvreuse_us"]["median"], r["dynamo_us"]["median"]
        assert r["ratio"] == pytest.approx(theirs / ours, rel=0.02)


def test_bad_options_are_one_line() -> None:
    proc = _bench("--replicas", "0")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--replicas" in proc.stderr
