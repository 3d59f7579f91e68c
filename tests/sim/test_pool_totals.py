"""Pools held at once on one machine stay under the ceiling of one pool (16,777,216 blocks):
a fleet whose replicas' pools pass it in all is refused in one line before any is built, and a
sweep runs no more cases at once than their pools allow together."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvreuse.cli import main
from kvreuse.sim import sweep
from kvreuse.sim.generators import shared_prefix
from kvreuse.sim.sweep import Case

LIMIT = 16_777_216  # blocks: the most one pool may have, and every pool held at once together


def _workload(tmp_path: Path) -> Path:
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in shared_prefix(64, 16, 2, max_tokens=1)))
    return path


@pytest.mark.parametrize(
    ("replicas", "num_blocks"),
    [(64, LIMIT), (2, LIMIT // 2 + 1)],  # 190 GB of bookkeeping; 2 blocks past the limit
)
def test_a_fleet_past_the_limit_in_all_is_one_line_naming_the_total(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], replicas: int, num_blocks: int
) -> None:
    out = tmp_path / "o"
    code = main(["simulate", "--geometry", "attention-16", str(_workload(tmp_path)), "--out",
                 str(out), "--replicas", str(replicas), "--num-blocks", str(num_blocks),
                 "--no-plots", "--quiet"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    total = replicas * num_blocks
    assert err.startswith(
        f"kvreuse simulate: {replicas} replicas × {num_blocks:,} blocks = {total:,} blocks in all "
        "is too large: "
    )
    assert f"the limit is {LIMIT:,} blocks in all" in err and "--replicas" in err
    assert not (out / "fleet-requests-exact.jsonl").exists()  # refused before the run


def test_a_fleet_within_the_limit_runs(tmp_path: Path) -> None:
    out = tmp_path / "o"
    code = main(["simulate", "--geometry", "attention-16", str(_workload(tmp_path)), "--out",
                 str(out), "--replicas", "4", "--num-blocks", "1000", "--no-plots",
                 "--quiet"])  # fmt: skip
    assert code == 0
    assert json.loads((out / "fleet.json").read_text())["replicas"] == 4


def test_a_sweep_runs_no_more_cases_at_once_than_their_pools_allow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "log"
    real = sweep.run_case

    def logged(case: Case, workload: list, rate: float) -> dict:
        blocks = case.deployment.cache.num_blocks
        with log.open("a") as f:  # one write a line: the workers' lines do not interleave
            f.write(f"{time.monotonic()} {blocks}\n")
        time.sleep(0.5)  # long enough that cases started together overlap
        row = real(case, workload, rate)
        with log.open("a") as f:
            f.write(f"{time.monotonic()} -{blocks}\n")
        return row

    monkeypatch.setattr(sweep, "run_case", logged)  # the forked workers run it too
    # the limit, lowered so that small pools test it: 1,251 + 1,876 + 2,501 blocks in all
    monkeypatch.setattr(sweep, "MAX_BLOCKS_AT_ONCE", 4_400, raising=False)
    out = tmp_path / "o"
    code = main(["sweep", str(_workload(tmp_path)), "--geometry", "attention-16", "--capacity",
                 "20K,30K,40K", "--jobs", "3", "--out", str(out), "--no-plots",
                 "--quiet"])  # fmt: skip
    assert code == 0
    events = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
    assert len(events) == 6
    held = peak = 0.0
    for _, blocks in events:
        held += blocks
        peak = max(peak, held)
    assert peak <= 4_400, f"{peak:,.0f} blocks were held at once"
    rows = json.loads((out / "sweep.json").read_text())["cases"]
    assert [r["num_blocks"] for r in rows] == [1_251, 1_876, 2_501]  # every case, in order
