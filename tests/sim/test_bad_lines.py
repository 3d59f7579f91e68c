"""Lines no reader can take (nested too deep, an integer too long to read, bytes that are not
UTF-8): one error line naming the file, the line and what is allowed, exit 2, in every command
that reads a workload or a trace."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvreuse.cli import main

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
