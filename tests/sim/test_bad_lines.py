"""Lines no reader can take (nested too deep, an integer too long to read, bytes that are not
UTF-8) and trace records whose arrival cannot be written: one error line naming the file, the
line and what is allowed, exit 2, in every command that reads a workload or a trace."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvreuse.cli import main

MAX_ARRIVAL_S = 2**32  # seconds: the latest arrival a workload line may have

WORKLOAD_LINE = {"id": "a", "prompt": {"tokens": [1, 2, 3]}, "max_tokens": 1}
MOONCAKE = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}
BAILIAN = {
    "chat_id": 1,
    "parent_chat_id": -1,
    "timestamp": 0.5,
    "input_length": 20,
    "output_length": 3,
    "type": "text",
    "turn": 1,
    "hash_ids": [1, 2],
}

BAD_LINES = {
    "a deep array": (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 100 levels"),
    "a deep object": (
        b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
        "nested deeper than 100 levels",
    ),
    "a long integer": (b'{"timestamp": ' + b"9" * 5000 + b"}", "more than 4,300 digits"),
    "bytes not UTF-8": (b'{"id": "\xff\xfe"}', "not UTF-8 text"),
}


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def _commands(tmp_path: Path) -> dict[str, tuple[list[str], bytes]]:
    """Per command: its arguments before the file, and a good first line for it."""
    out = str(tmp_path / "out")
    common = ["--out", out, "--quiet", "--no-plots"]
    good = _line(WORKLOAD_LINE)
    return {
        "workload import mooncake": (["workload", "import", "mooncake"], _line(MOONCAKE)),
        "workload import bailian": (["workload", "import", "bailian"], _line(BAILIAN)),
        "simulate": (["simulate", "--geometry", "attention-16", *common], good),
        "simulate --replicas": (
            ["simulate", "--geometry", "attention-16", "--replicas", "2", *common],
            good,
        ),
        "sweep": (["sweep", "--geometry", "attention-16", "--jobs", "1", *common], good),
    }


@pytest.mark.parametrize("bad", list(BAD_LINES))
@pytest.mark.parametrize(
    "command",
    ["workload import mooncake", "workload import bailian", "simulate", "simulate --replicas",
     "sweep"],
)  # fmt: skip
def test_an_unreadable_line_is_one_line_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, bad: str
) -> None:
    args, good = _commands(tmp_path)[command]
    line, what = BAD_LINES[bad]
    path = tmp_path / "in.jsonl"
    path.write_bytes(good + b"\n" + line + b"\n")
    assert main([*args, str(path)]) == 2
    err = capsys.readouterr().err
    prog = "kvreuse " + command.split(" --")[0].removesuffix(" mooncake").removesuffix(" bailian")
    assert err.count("\n") == 1, err
    assert err.startswith(f"{prog}") and f"{path}: line 2: " in err and what in err, err
    assert "Traceback" not in err


def test_the_limits_say_what_is_allowed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "in.jsonl"
    for line, allowed in [
        (BAD_LINES["a deep array"][0], "at most 100 levels of arrays and objects"),
        (BAD_LINES["a long integer"][0], "integers of at most 4,300 digits"),
    ]:
        path.write_bytes(line + b"\n")
        assert main(["simulate", "--geometry", "attention-16", str(path), "--out",
                     str(tmp_path / "o"), "--no-plots"]) == 2  # fmt: skip
        assert allowed in capsys.readouterr().err


def test_a_line_nested_within_the_limit_is_read(tmp_path: Path) -> None:
    prompt: dict[str, Any] = {"tokens": [1, 2, 3]}
    for _ in range(40):  # 81 levels: a concat of a concat of … (no workload needs as many)
        prompt = {"concat": [prompt]}
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({**WORKLOAD_LINE, "prompt": prompt}) + "\n")
    out = tmp_path / "o"
    assert main(["simulate", "--geometry", "attention-16", str(path), "--out", str(out),
                 "--no-plots", "--quiet"]) == 0  # fmt: skip
    assert json.loads((out / "summary.json").read_text())["requests"] == 1


def _strict(line: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize(
    ("fmt", "record", "scale"),
    [
        ("mooncake", {**MOONCAKE, "timestamp": 1e308}, "1000000"),  # × 1e-3 × 1e6: inf
        ("mooncake", {**MOONCAKE, "timestamp": 1e300}, "1"),  # finite, and 10**289 years
        ("bailian", {**BAILIAN, "timestamp": 1e303}, "1000000"),
        ("bailian", {**BAILIAN, "timestamp": MAX_ARRIVAL_S + 1}, "1"),
    ],
)
def test_an_arrival_past_the_limit_is_refused_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str, record: dict, scale: str
) -> None:
    first = MOONCAKE if fmt == "mooncake" else {**BAILIAN, "chat_id": 0}
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(first) + "\n" + json.dumps(record) + "\n")
    assert main(["workload", "import", fmt, str(path), "--time-scale", scale]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"kvreuse workload import {fmt}: {path}: line 2: ")
    assert f"at most {MAX_ARRIVAL_S:,} s" in captured.err and "--time-scale" in captured.err
    written = [_strict(line) for line in captured.out.splitlines()]
    assert len(written) == 1 and math.isfinite(written[0]["arrival"])


def test_a_workload_arrival_past_the_limit_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({**WORKLOAD_LINE, "arrival": 1e300}) + "\n")
    code = main(["simulate", "--geometry", "attention-16", str(path), "--out",
                 str(tmp_path / "o"), "--no-plots"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert f"{path}: line 1: field 'arrival'" in err and f"{MAX_ARRIVAL_S:,}" in err


def test_the_limit_arrival_itself_is_written_and_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({**BAILIAN, "timestamp": MAX_ARRIVAL_S}) + "\n")
    assert main(["workload", "import", "bailian", str(path)]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert _strict(line)["arrival"] == MAX_ARRIVAL_S
