"""`kvreuse qualify` through the real command line: exit codes (2 when nothing could be checked,
1 when the server failed, 130 on Ctrl-C), progress per scenario on stderr, and what a Ctrl-C
keeps."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

KVREUSE = [sys.executable, "-m", "kvreuse"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVREUSE, *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--url", "http://127.0.0.1:9"), "--url http://127.0.0.1:9: cannot connect"),
        (("--fake", "--geometry", "nope"), "unknown geometry 'nope'"),
        (("--num-blocks", "1"), "argument --num-blocks: must be a whole number in 2"),
        (("--num-blocks", "1000000000"), "about 177.0 GB"),
    ],
)
def test_a_usage_error_is_one_line_and_exit_2(
    tmp_path: Path, args: tuple[str, ...], fragment: str
) -> None:
    proc = run("qualify", "--quick", "--out", str(tmp_path / "q"), *args)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines
    assert not (tmp_path / "q" / "qualify.json").exists()


def test_an_out_that_is_a_file_is_refused_before_any_scenario(tmp_path: Path) -> None:
    taken = tmp_path / "taken"
    taken.write_text("x")
    proc = run("qualify", "--fake", "--quick", "--out", str(taken))
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"kvreuse qualify: --out {taken}: exists and is not a directory"
    ]


def test_progress_names_each_scenario_as_it_runs(tmp_path: Path) -> None:
    proc = run("qualify", "--fake", "--quick", "--out", str(tmp_path / "q"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    names = ["a-grid", "b-shared-prefix", "c-agent", "d-retrieval", "e-pressure"]
    assert [line.split(": ")[1].split(" ")[0] for line in lines[::2]] == names
    assert all(": pass (" in line and " requests, " in line for line in lines[1::2])
    assert run("qualify", "--fake", "--quick", "--quiet", "--out", str(tmp_path / "r")).stderr == ""


def test_ctrl_c_keeps_the_finished_scenarios(tmp_path: Path) -> None:
    out = tmp_path / "q"
    with subprocess.Popen(
        [*KVREUSE, "qualify", "--fake", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # stop once the first scenario has passed
            seen.append(line.rstrip("\n"))
            if ": pass (" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=300)
    assert proc.returncode == 130, rest
    assert "Traceback" not in rest
    last = rest.splitlines()[-1]
    doc = json.loads((out / "qualify.json").read_text())
    done = [s["scenario"] for s in doc["scenarios"]]
    assert done == ["a-grid", "b-shared-prefix"][: len(done)] and done  # b: a slow machine
    assert re.fullmatch(
        rf"kvreuse qualify: interrupted( during [a-z-]+)? after {len(done)} scenario\(s\); "
        rf"their report is in {re.escape(str(out))}/qualify\.md",
        last,
    ), last
    assert doc["interrupted"] and not doc["passed"]
    assert (out / "qualify.md").read_text().startswith("# kvreuse qualify: INTERRUPTED")
