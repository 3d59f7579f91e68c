"""`kvreuse workload import`: Mooncake and Bailian records become workload lines, one per record,
with the fields mapped as the formats define them; options cut a trace down; a bad record is one
line naming the file, the line and the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvreuse.sim.feed import static_length
from kvreuse.sim.traces import ImportOptions, ImportStats, import_trace
from kvreuse.sim.workload import WorkloadError, load_workload

DATA = Path(__file__).parents[1] / "data"
CONVERSATION = DATA / "mooncake_conversation_excerpt.jsonl"
SYNTHETIC = DATA / "mooncake_synthetic_excerpt.jsonl"
BAILIAN = DATA / "bailian_schema_excerpt.jsonl"
KVREUSE = [sys.executable, "-m", "kvreuse"]


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def imported(fmt: str, lines: list[str], **options: Any) -> tuple[list[dict], ImportStats]:
    stats = ImportStats()
    out = list(import_trace(fmt, lines, "trace.jsonl", ImportOptions(**options), stats))
    return out, stats


def mooncake(**fields: Any) -> str:
    rec = {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}
    return json.dumps({**rec, **fields})


def bailian(**fields: Any) -> str:
    rec = {
        "chat_id": 1,
        "parent_chat_id": -1,
        "timestamp": 0.5,
        "input_length": 20,
        "output_length": 3,
        "type": "text",
        "turn": 1,
        "hash_ids": [1, 2],
    }
    return json.dumps({**rec, **fields})


@pytest.mark.parametrize("path", [CONVERSATION, SYNTHETIC])
def test_mooncake_fields_map_onto_the_workload(path: Path) -> None:
    recs = records(path)
    lines, stats = imported("mooncake", path.read_text().splitlines())
    assert len(lines) == len(recs) == stats.num_written == stats.num_records
    for n, (rec, line) in enumerate(zip(recs, lines, strict=True), 1):
        assert line["id"] == f"r{n}"
        assert line["arrival"] == pytest.approx(rec["timestamp"] / 1000)  # ms → s
        assert line["max_tokens"] == rec["output_length"]
        blocks = line["prompt"]["blocks"]
        assert blocks["len"] == rec["input_length"] and blocks["block_tokens"] == 512
        assert blocks["ids"] == rec["hash_ids"][: -(-rec["input_length"] // 512)]
    assert stats.prompt_tokens == sum(r["input_length"] for r in recs)
    workload = load_workload(json.dumps(x) for x in lines)
    assert [static_length(w.prompt) for w in workload] == [r["input_length"] for r in recs]


def test_bailian_sessions_become_dependencies() -> None:
    recs = records(BAILIAN)
    lines, stats = imported("bailian", BAILIAN.read_text().splitlines())
    by_chat = {r["chat_id"]: r for r in recs}
    assert len(lines) == len(recs)
    for rec, line in zip(recs, lines, strict=True):
        assert line["id"] == f"{rec['type']}-{rec['chat_id']}"
        assert line["arrival"] == pytest.approx(rec["timestamp"])  # already seconds
        assert line["prompt"]["blocks"]["block_tokens"] == 16
        parent = by_chat.get(rec["parent_chat_id"])
        if parent is None:
            assert "after" not in line
        else:
            assert line["after"] == f"{parent['type']}-{parent['chat_id']}"
    # chat 20 names a parent before the excerpt: it waits for no one, and the import says so
    assert stats.num_orphans == 1 and "parent_chat_id" in stats.summary()
    assert len(load_workload(json.dumps(x) for x in lines)) == len(recs)


def test_block_tokens_limit_and_time_scale() -> None:
    text = CONVERSATION.read_text().splitlines()
    lines, stats = imported("mooncake", [*text[:5], "not json"], limit=5, time_scale=0.5)
    assert len(lines) == 5 and stats.num_records == 5  # the bad 6th line is never read
    first = records(CONVERSATION)[:5]
    assert [x["arrival"] for x in lines] == [r["timestamp"] / 2000 for r in first]
    lines, _ = imported("mooncake", text[:1], block_tokens=1024)
    blocks = lines[0]["prompt"]["blocks"]  # 6,758 tokens: 7 of the 14 ids cover them
    assert blocks["block_tokens"] == 1024 and blocks["ids"] == first[0]["hash_ids"][:7]


def test_a_mooncake_sample_is_a_seeded_fraction_of_the_records() -> None:
    text = [mooncake(timestamp=i, hash_ids=[i, i + 1]) for i in range(2000)]
    first, _ = imported("mooncake", text, sample=0.25, seed=1)
    again, _ = imported("mooncake", text, sample=0.25, seed=1)
    other, _ = imported("mooncake", text, sample=0.25, seed=2)
    assert first == again and first != other
    assert 400 <= len(first) <= 600  # 500 expected; 5 standard deviations is ±97
    assert len(imported("mooncake", text, sample=1.0)[0]) == 2000


def test_a_bailian_sample_keeps_or_drops_whole_sessions() -> None:
    text = []
    for root in range(300):  # 300 sessions of 3 turns: chat ids 3r, 3r+1, 3r+2
        for turn in range(3):
            parent = -1 if turn == 0 else 3 * root + turn - 1
            text.append(bailian(chat_id=3 * root + turn, parent_chat_id=parent, turn=turn + 1))
    lines, _ = imported("bailian", text, sample=0.5, seed=3)
    kept = {int(x["id"].split("-")[1]) for x in lines}
    assert {c // 3 for c in kept} == {c // 3 for c in kept if c % 3 == 0}  # sessions whole
    assert len(kept) % 3 == 0 and 90 <= len(kept) // 3 <= 210
    assert load_workload(json.dumps(x) for x in lines)  # every `after` names a kept request


def test_input_past_the_hash_ids_is_unique_to_its_request() -> None:
    """600 tokens on two 256-token blocks: the last 88 tokens are not in the trace; they become
    a random prompt seeded by the record, so two such records share exactly their blocks."""
    text = [mooncake(), mooncake(timestamp=5)]
    lines, stats = imported("mooncake", text, block_tokens=256)
    assert stats.num_past_ids == 2 and "unique to their request" in stats.summary()
    from kvreuse.sim.workload import resolve_prompt

    a, b = (resolve_prompt(w.prompt, {}) for w in load_workload(json.dumps(x) for x in lines))
    assert len(a) == len(b) == 600 and a[:512] == b[:512] and a[512] != b[512]


def test_an_empty_output_generates_one_token() -> None:
    lines, stats = imported("mooncake", [mooncake(output_length=0)])
    assert lines[0]["max_tokens"] == 1 and stats.num_no_output == 1


BAD_MOONCAKE = [
    ("[1]", "line 2: expected a JSON object"),
    ("{", "line 2: not valid JSON"),
    (json.dumps({"timestamp": 0, "input_length": 5, "hash_ids": [1]}), "missing field(s) ['out"),
    (mooncake(extra=1), "unknown field(s) ['extra']"),
    (mooncake(timestamp=-1), "line 2: field 'timestamp' must be a finite number"),
    (mooncake(timestamp="5"), "field 'timestamp'"),
    (mooncake(timestamp=True), "field 'timestamp'"),
    (mooncake(input_length=0), "line 2: field 'input_length' must be an int in 1"),
    (mooncake(input_length=5.0), "field 'input_length'"),
    (mooncake(input_length=2**40), "field 'input_length'"),
    (mooncake(output_length=-1), "field 'output_length'"),
    (mooncake(output_length=None), "field 'output_length'"),
    (mooncake(hash_ids=7), "line 2: field 'hash_ids' must be a list"),
    (mooncake(hash_ids=[1, -2]), "field 'hash_ids' must hold ints in [0, 2**32), got -2"),
    (mooncake(hash_ids=[2**32]), "field 'hash_ids'"),
    (mooncake(hash_ids=[1.5]), "field 'hash_ids'"),
]


@pytest.mark.parametrize(("line", "fragment"), BAD_MOONCAKE)
def test_a_bad_mooncake_record_names_file_line_and_field(line: str, fragment: str) -> None:
    with pytest.raises(WorkloadError, match=r"^trace\.jsonl: line 2") as err:
        list(import_trace("mooncake", [mooncake(), line], "trace.jsonl", ImportOptions()))
    assert fragment in str(err.value) and "\n" not in str(err.value)


BAD_BAILIAN = [
    (bailian(chat_id=-1), "field 'chat_id'"),
    (bailian(chat_id=1), "duplicate chat_id 1"),
    (bailian(chat_id=2, parent_chat_id=-2), "field 'parent_chat_id'"),
    (bailian(chat_id=2, type=""), "field 'type' must be a non-empty string"),
    (bailian(chat_id=2, type=3), "field 'type'"),
    (bailian(chat_id=2, turn="2"), "field 'turn'"),
    (json.dumps({"chat_id": 2, "timestamp": 1}), "missing field(s) ['parent_chat_id'"),
]


@pytest.mark.parametrize(("line", "fragment"), BAD_BAILIAN)
def test_a_bad_bailian_record_names_file_line_and_field(line: str, fragment: str) -> None:
    with pytest.raises(WorkloadError, match=r"^trace\.jsonl: line 2") as err:
        list(import_trace("bailian", [bailian(), line], "trace.jsonl", ImportOptions()))
    assert fragment in str(err.value)


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVREUSE, "workload", "import", *args],
        capture_output=True,
        text=True,
        input=stdin,
        timeout=120,
    )


def test_the_command_streams_a_trace_to_stdout(tmp_path: Path) -> None:
    done = run("bailian", str(BAILIAN), "--limit", "10")
    assert done.returncode == 0, done.stderr
    assert len(load_workload(done.stdout.splitlines())) == 10
    assert done.stderr.count("\n") == 1 and "wrote 10 requests" in done.stderr
    piped = run("mooncake", "-", stdin=CONVERSATION.read_text())
    assert piped.returncode == 0 and len(piped.stdout.splitlines()) == 30


def test_the_command_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(mooncake() + "\n" + mooncake(hash_ids="x") + "\n")
    for args, fragment in [
        (("mooncake", str(bad)), f"{bad}: line 2: field 'hash_ids'"),
        (("mooncake", str(tmp_path / "none.jsonl")), "cannot read the trace"),
        (("mooncake", str(CONVERSATION), "--sample", "0"), "--sample"),
        (("mooncake", str(CONVERSATION), "--time-scale", "-1"), "--time-scale"),
        (("mooncake", str(CONVERSATION), "--block-tokens", "0"), "--block-tokens"),
        (("parquet", str(CONVERSATION)), "invalid choice"),
    ]:
        done = run(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and fragment in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(mooncake().encode() + b"\n\xff\xfe\n")
    done = run("mooncake", str(latin))
    assert done.returncode == 2 and "line 2: not UTF-8 text" in done.stderr


def simulate(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [*KVREUSE, "simulate", "--geometry", "hybrid-dcp4", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(("fmt", "path"), [("mooncake", CONVERSATION), ("bailian", BAILIAN)])
def test_simulate_reads_a_trace_as_the_import_writes_it(
    tmp_path: Path, fmt: str, path: Path
) -> None:
    """`simulate --trace FORMAT FILE` is `workload import FORMAT FILE` then `simulate`: the
    same rows and summary, and the import's line on stderr."""
    workload = tmp_path / "workload.jsonl"
    done = run(fmt, str(path), "--time-scale", "0.5")
    assert done.returncode == 0, done.stderr
    workload.write_text(done.stdout)
    common = ["--capacity-tokens", "200K", "--no-plots", "--no-compare", "--json"]
    via_file = simulate(str(workload), "--out", str(tmp_path / "a"), *common)
    direct = simulate(
        str(path), "--trace", fmt, "--time-scale", "0.5", "--out", str(tmp_path / "b"), *common
    )
    assert via_file.returncode == direct.returncode == 0, direct.stderr
    rows = [(tmp_path / d / "requests.jsonl").read_text() for d in ("a", "b")]
    assert rows[0] == rows[1] and rows[0].count("\n") == 30
    summaries = [json.loads(p.stdout) for p in (via_file, direct)]
    assert summaries[0] == summaries[1] and summaries[0]["hits"] > 0
    assert f"{path}: imported 30 requests" in direct.stderr


def test_simulate_refuses_a_bad_trace_in_one_line(tmp_path: Path) -> None:
    workload = tmp_path / "workload.jsonl"
    workload.write_text(run("mooncake", str(CONVERSATION)).stdout)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(mooncake() + "\n" + mooncake(input_length=0) + "\n")
    for args, fragment in [
        ((str(bad), "--trace", "mooncake"), f"{bad}: line 2: field 'input_length'"),
        ((str(workload), "--trace", "mooncake"), "line 1: missing field(s)"),
        ((str(tmp_path / "none.jsonl"), "--trace", "mooncake"), "cannot read the trace"),
        ((str(workload), "--time-scale", "2"), "give --trace FORMAT with it"),
        ((str(CONVERSATION), "--trace", "parquet"), "invalid choice"),
    ]:
        done = simulate(*args, "--out", str(tmp_path / "out"), "--quiet")
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.count("\n") in (1, 3) and fragment in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
