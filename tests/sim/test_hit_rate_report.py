"""A run states one hit rate: Σ cached / Σ prompt tokens of the admitted requests (the core's
hits / queries), in its table, its totals, report.md and the fleet's table alike, and names the
requests it leaves out. When deferral computed more prefill than the run without it, the report
says how the two runs differed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvreuse.cli import main
from kvreuse.sim.report import _deferral_section

LINES = [
    {"id": "big-0", "prompt": {"random": {"seed": 1, "len": 3_000}}, "max_tokens": 1},
    {"id": "doc-0", "prompt": {"random": {"seed": 2, "len": 600}}, "max_tokens": 1},
    {
        "id": "doc-1",
        "prompt": {"random": {"seed": 2, "len": 600}},
        "max_tokens": 1,
        "after": "doc-0",
    },
]


@pytest.fixture
def run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, str, dict]:
    wl = tmp_path / "w.jsonl"
    wl.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    out = tmp_path / "o"
    argv = ["simulate", "--geometry", "attention-16", str(wl), "--out", str(out), "--no-plots"]
    assert main([*argv, "--quiet", "--num-blocks", "64"]) == 1  # big-0 never fits 63 blocks
    shown = capsys.readouterr().out
    return out, shown, json.loads((out / "summary.json").read_text())


def _rates(text: str) -> set[str]:
    return set(re.findall(r"\d+\.\d+%", text))


def test_the_table_and_the_totals_state_the_same_hit_rate(run: tuple[Path, str, dict]) -> None:
    out, shown, s = run
    # 592 of doc-1's 600 tokens (37 pages; the last token is computed) of 1,200 admitted
    assert (s["hits"], s["queries"]) == (592, 1_200)
    rate = "49.3%"
    totals = next(line for line in shown.splitlines() if line.startswith("attention-16:"))
    assert totals == (
        f"attention-16: 3 requests; hit rate {rate}: 592 cached of 1,200 prompt tokens of the 2 "
        "admitted requests (it leaves out 1 request never admitted, 3,000 prompt tokens)"
    )
    kinds = {line.split()[0]: line for line in shown.splitlines()[1:3]}
    assert _rates(kinds["doc-*"]) == {rate} and "1,200" in kinds["doc-*"]
    assert kinds["big-*"].split()[1:3] == ["1", "1"]  # n, refused
    report = (out / "report.md").read_text()
    assert f"hit rate {rate}: 592 cached of 1,200 prompt tokens" in report
    assert "1 request never admitted" in report


def test_the_fleet_states_the_same_hit_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = tmp_path / "w.jsonl"
    wl.write_text("".join(json.dumps(x) + "\n" for x in LINES))
    out = tmp_path / "f"
    argv = ["simulate", "--geometry", "attention-16", str(wl), "--out", str(out), "--no-plots"]
    assert main([*argv, "--quiet", "--num-blocks", "64", "--replicas", "1"]) == 1
    shown = capsys.readouterr().out
    fleet = json.loads((out / "fleet.json").read_text())["runs"][0]
    assert fleet["hit_rate"] == 592 / 1_200 and fleet["admitted_prompt_tokens"] == 1_200
    assert "49.3%" in shown
    assert (
        "hit rate: cached / prompt tokens of the admitted requests; it leaves out 1 request "
        "never admitted (3,000 prompt tokens)"
    ) in shown


def _summary(with_: int, without: int) -> dict:
    off = {
        "prefill_tokens_computed": without,
        "hits": 10,
        "simulated_seconds": 2.0,
        "preemptions": 4,
        "evicted_blocks": 900,
    }
    return {
        "deferral_waits": 3,
        "prefill_tokens_computed": with_,
        "hits": 12,
        "simulated_seconds": 2.5,
        "preemptions": 7,
        "evicted_blocks": 1_000,
        "without_deferral": off,
    }


def test_deferral_that_computed_more_is_explained_by_the_runs_difference() -> None:
    text = "\n".join(_deferral_section(_summary(58_211_991, 58_205_325)))
    assert "Deferral computed 6,666 more prefill tokens" in text
    assert "evicted 1,000 and 900 blocks and preempted 7 and 4 times" in text
    assert "| with deferral | 58,211,991 | 12 | 7 | 1,000 |" in text
    saved = "\n".join(_deferral_section(_summary(6_144, 10_240)))
    assert "Deferral saved 4,096 prefill tokens." in saved and "more" not in saved
