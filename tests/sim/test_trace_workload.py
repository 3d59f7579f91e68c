"""Imported traces in the simulator: a `blocks` prompt expands to deterministic tokens that two
prompts share exactly as far as they share leading ids, and a replay caches exactly what the
prefix-cache rules allow; `simulate --num-blocks / --capacity-tokens` size the pool."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvreuse.deployment import preset
from kvreuse.sim.run import simulate
from kvreuse.sim.traces import ImportOptions, import_trace
from kvreuse.sim.workload import (
    MAX_BLOCK_TOKENS,
    WorkloadError,
    block_tokens,
    load_workload,
    resolve_prompt,
)

DATA = Path(__file__).parents[1] / "data"
EXCERPTS = [
    ("mooncake", DATA / "mooncake_conversation_excerpt.jsonl"),
    ("mooncake", DATA / "mooncake_synthetic_excerpt.jsonl"),
    ("bailian", DATA / "bailian_schema_excerpt.jsonl"),
]
# Prompts that continue another's partial last block (1,100 tokens end 76 tokens into block 3),
# diverge inside a block's run (block 9 after 1, 2), or share nothing.
CONTINUED = [
    {"timestamp": 0, "input_length": 1100, "output_length": 2, "hash_ids": [1, 2, 3]},
    {"timestamp": 1, "input_length": 2000, "output_length": 2, "hash_ids": [1, 2, 3, 4]},
    {"timestamp": 2, "input_length": 1500, "output_length": 2, "hash_ids": [1, 2, 9]},
    {"timestamp": 3, "input_length": 300, "output_length": 2, "hash_ids": [1]},
    {"timestamp": 4, "input_length": 1024, "output_length": 2, "hash_ids": [7, 8]},
    {"timestamp": 5, "input_length": 1030, "output_length": 2, "hash_ids": [1, 2, 3, 4]},
]
CASES = [*((fmt, path.read_text().splitlines()) for fmt, path in EXCERPTS)]
CASES.append(("mooncake", [json.dumps(r) for r in CONTINUED]))
IDS = [path.stem for _, path in EXCERPTS] + ["continued"]
KVREUSE = [sys.executable, "-m", "kvreuse"]


def workload_of(fmt: str, text: list[str]):
    lines = import_trace(fmt, text, "trace.jsonl", ImportOptions())
    return load_workload(json.dumps(x) for x in lines)


def blocks_line(ids: list, size: object = 4, length: object = 6) -> str:
    prompt = {"blocks": {"ids": ids, "block_tokens": size, "len": length}}
    return json.dumps({"id": "a", "prompt": prompt, "max_tokens": 1})


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def leading_run(a: list[int], b: list[int]) -> int:
    return common_prefix(list(a), list(b))


def test_a_block_is_a_fixed_function_of_id_and_position() -> None:
    block = block_tokens(7, 512)
    assert block[0] == 7 and block == block_tokens(7, 512)
    assert block_tokens(7, 16) == block[:16]  # a partial block is the start of the full one
    other = block_tokens(8, 512)
    assert other[0] == 8 and other[1:] == block[1:]  # only the id differs: the chain does the rest
    assert all(0 <= t < 2**32 for t in block) and len(set(block)) > 500
    assert block_tokens(7, 2) == block_tokens(7, 512)[:2] and block_tokens(7, 1).tolist() == [7]
    assert block_tokens(2**32 - 1, 4)[0] == 2**32 - 1


def by_ids(a: dict, b: dict) -> int:
    """Tokens two blocks prompts share by the trace: common leading ids, within both lengths."""
    return min(leading_run(a["ids"], b["ids"]) * a["block_tokens"], a["len"], b["len"])


@pytest.mark.parametrize(("fmt", "text"), CASES, ids=IDS)
def test_prompts_share_exactly_their_common_leading_blocks(fmt: str, text: list[str]) -> None:
    """Two prompts agree on min(common leading ids × block tokens, their lengths) tokens."""
    reqs = workload_of(fmt, text)
    prompts = [resolve_prompt(w.prompt, {}) for w in reqs]
    for i, (wa, a) in enumerate(zip(reqs, prompts, strict=True)):
        for wb, b in list(zip(reqs, prompts, strict=True))[:i]:
            expected = by_ids(wa.prompt["blocks"], wb.prompt["blocks"])
            assert common_prefix(a, b) == expected, (wa.request_id, wb.request_id)


@pytest.mark.parametrize(("fmt", "text"), CASES, ids=IDS)
def test_a_serial_replay_reuses_what_the_rules_allow(fmt: str, text: list[str]) -> None:
    """One request at a time on 16-token pages with room for everything: each request reuses
    the longest prefix it shares with an earlier prompt by the trace's ids (common leading ids ×
    block tokens, within both lengths), but not its own last token, in whole 16-token pages
    (earlier outputs share nothing: the fake engine's tokens are not the trace's)."""
    reqs = workload_of(fmt, text)
    dep = preset("attention-16")
    dep = replace(
        dep,
        cache=replace(dep.cache, num_blocks=1 << 16),
        sched=replace(dep.sched, max_num_seqs=1),
    )
    result = simulate(dep, reqs)
    assert result.summary["reconciled"] and result.summary["evicted_blocks"] == 0
    blocks = [w.prompt["blocks"] for w in reqs]
    for i, row in enumerate(result.requests):
        shared = max((by_ids(blocks[i], b) for b in blocks[:i]), default=0)
        expected = min(shared, blocks[i]["len"] - 1) // 16 * 16
        assert row["cached_tokens"] == expected, row["id"]
    assert result.summary["hits"] > 0


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        (blocks_line([]), "blocks.ids: a non-empty list"),
        (blocks_line([1, -1]), "block ids are ints in [0, 2**32), got -1"),
        (blocks_line([1, 2**32]), "blocks.ids"),
        (blocks_line([1, True]), "blocks.ids"),
        (blocks_line([1, 2], size=0), "blocks.block_tokens: an int in 1"),
        (blocks_line([1, 2], size=MAX_BLOCK_TOKENS + 1), "blocks.block_tokens"),
        (blocks_line([1, 2], length=9), "blocks.len: an int in 1 … 8"),
        (blocks_line([1, 2], length=0), "blocks.len"),
        (blocks_line([1, 2], length="6"), "blocks.len"),
        ('{"id": "a", "prompt": {"blocks": {"ids": [1]}}, "max_tokens": 1}', "blocks:"),
    ],
)
def test_a_bad_blocks_prompt_names_line_and_field(line: str, fragment: str) -> None:
    with pytest.raises(WorkloadError, match=r"^line 1: field 'prompt'\.blocks") as err:
        load_workload([line])
    assert fragment in str(err.value)


def test_blocks_compose_with_concat_and_history() -> None:
    lines = [
        blocks_line([5, 6], length=6),
        json.dumps(
            {
                "id": "b",
                "prompt": {
                    "concat": [
                        {"history": "a"},
                        {"blocks": {"ids": [9], "block_tokens": 4, "len": 2}},
                    ]
                },
                "max_tokens": 1,
            }
        ),
    ]
    a, b = load_workload(lines)
    history = {"a": [*resolve_prompt(a.prompt, {}), 42]}
    tokens = resolve_prompt(b.prompt, history)
    assert tokens == [*history["a"], 9, block_tokens(9, 2)[1]]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVREUSE, *args], capture_output=True, text=True, timeout=120)


def test_simulate_sizes_the_pool_from_the_command_line(tmp_path: Path) -> None:
    wl = tmp_path / "w.jsonl"
    lines = import_trace("mooncake", CASES[1][1], "x", ImportOptions())
    wl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = ("simulate", "--geometry", "attention-16", str(wl), "--no-plots", "--json")
    done = run(*common, "--out", str(tmp_path / "a"), "--capacity-tokens", "1000000")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["capacity_tokens"] == 1_000_000 and summary["reconciled"]
    done = run(*common, "--out", str(tmp_path / "b"), "--num-blocks", "4097")
    assert done.returncode == 0, done.stderr  # 65,536 tokens: the longest request fits
    assert json.loads(done.stdout)["capacity_tokens"] == 4096 * 16
    for extra, fragment in [
        (("--num-blocks", "10", "--capacity-tokens", "10"), "not allowed with"),
        (("--num-blocks", "1"), "--num-blocks"),
        (("--capacity-tokens", "10000000000"), "--capacity-tokens"),
    ]:
        done = run(*common, "--out", str(tmp_path / "c"), *extra)
        assert done.returncode == 2 and fragment in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


def test_simulate_takes_the_cost_from_the_geometry_unless_an_option_is_given(
    tmp_path: Path,
) -> None:
    """One cold 1,000-token prompt and one output token is one prefill step of 1,000 tokens:
    1 s at the file's 1,000 tokens/s, 0.5 s at --prefill-tokens-per-s 2000, and 0.05 s at the
    default 20,000 on a geometry without [cost]."""
    geometry = tmp_path / "g.toml"
    geometry.write_text(
        '[cache]\nnum_blocks = 256\n[[groups]]\nkind = "full"\nblock_size = 16\n'
        "[cost]\nprefill_tokens_per_s = 1000\ndecode_step_s = 0\n"
    )
    wl = tmp_path / "w.jsonl"
    wl.write_text(
        json.dumps({"id": "a", "prompt": {"random": {"seed": 1, "len": 1000}}, "max_tokens": 1})
        + "\n"
    )
    for files, extra, seconds in [
        ((str(geometry),), (), 1.0),
        ((str(geometry),), ("--prefill-tokens-per-s", "2000"), 0.5),
        (("--geometry", "attention-16"), (), 0.05),
    ]:
        done = run(
            "simulate",
            *files,
            str(wl),
            "--out",
            str(tmp_path / "o"),
            "--no-plots",
            "--json",
            *extra,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["simulated_seconds"] == pytest.approx(seconds)
