"""Workload files and generators: every generator's output loads; bad lines name line and field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvreuse.sim import GENERATORS, WorkloadError, load_workload, random_tokens, resolve_prompt
from kvreuse.sim.generators import agent, pressure, resend_grid, retrieval, shared_prefix


def lines(objs: list[dict]) -> list[str]:
    return [json.dumps(o) for o in objs]


def test_resend_grid_shapes() -> None:
    reqs = load_workload(lines(resend_grid([255, 2048], extra=5)))
    assert [r.request_id for r in reqs] == [
        "cold-255",
        "warm-255",
        "appended-255",
        "cold-2048",
        "warm-2048",
        "appended-2048",
    ]
    hist: dict[str, list[int]] = {}
    cold, warm, appended = (resolve_prompt(r.prompt, hist) for r in reqs[3:])
    assert len(cold) == 2048 and warm == cold and appended[:2048] == cold and len(appended) == 2053
    assert reqs[4].after == "cold-2048" and reqs[5].after == "warm-2048"
    # one request at a time: each length's cold request waits for the previous length's last
    assert reqs[0].after is None and reqs[3].after == "appended-255"


def test_shared_prefix_agent_retrieval_pressure() -> None:
    sp = load_workload(lines(shared_prefix(64, 8, 4)))
    prompts = [resolve_prompt(r.prompt, {}) for r in sp]
    assert all(p[:64] == prompts[0][:64] for p in prompts) and len({tuple(p) for p in prompts}) == 4
    ag = load_workload(lines(agent(sessions=2, turns=3, user_len=4, tool_len=6, max_tokens=2)))
    assert len(ag) == 6 and ag[1].dependencies() == {"s0-t0"}
    history = {"s0-t0": [1, 2, 3, 4, 9, 9]}
    assert resolve_prompt(ag[1].prompt, history)[:6] == [1, 2, 3, 4, 9, 9]
    assert len(resolve_prompt(ag[1].prompt, history)) == 6 + 6 + 4
    rt = load_workload(lines(retrieval(100)))
    assert [r.request_id for r in rt] == ["doc-cold", "doc-warm"]
    pr = load_workload(lines(pressure(sequences=3, length=10, repeats=3)))
    # each replay pass runs in the reverse order of the pass before it
    assert [r.request_id for r in pr][3:] == ["q2-r1", "q1-r1", "q0-r1", "q0-r2", "q1-r2", "q2-r2"]
    assert resolve_prompt(pr[0].prompt, {}) == resolve_prompt(pr[5].prompt, {})


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_cli_generators_emit_loadable_jsonl(kind: str) -> None:
    args = {
        "pressure": ["--length", "64"],
        "retrieval": ["--length", "64"],
        "agent": ["--turns", "3"],
    }.get(kind, [])
    out = subprocess.run(
        [sys.executable, "-m", "kvreuse", "workload", kind, *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert load_workload(out.splitlines())


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: resend_grid([]), "at least one length"),
        (lambda: resend_grid([0]), "every length must be an integer"),
        (lambda: shared_prefix(0, 8, 4), "--prefix-len"),
        (lambda: agent(1, 0, 4, 4, 1), "--turns"),
        (lambda: pressure(1, 10, -1), "--repeats"),
    ],
)
def test_generator_options_are_validated(call, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        call()


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"id": "a", "prompt": {"tokens": [1]}}', "line 1: missing field 'max_tokens'"),
        (
            '{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 1, "colour": 1}',
            "line 1: unknown field",
        ),
        ('{"id": "a", "prompt": {"words": "hi"}, "max_tokens": 1}', "unknown prompt kind"),
        ('{"id": "a", "prompt": {"tokens": [-1]}, "max_tokens": 1}', "field 'prompt'.tokens"),
        ('{"id": "a", "prompt": {"random": {"seed": 1}}, "max_tokens": 1}', "random"),
        ('{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 0}', "'max_tokens' must be"),
        ('{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 1, "arrival": -1}', "'arrival'"),
        # Python's JSON reader takes NaN and Infinity; as seconds they are nonsense
        ('{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 1, "arrival": NaN}', "'arrival'"),
        (
            '{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 1, "arrival": Infinity}',
            "finite number of seconds",
        ),
        ('{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 1, "arrival": 1e999}', "finite"),
        (
            '{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 1, "arrival": 1'
            + "0" * 400
            + "}",
            "finite",
        ),
        ('{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 1, "arrival": "1"}', "finite"),
        (
            '{"id": "a", "prompt": {"random": {"seed": 1, "len": 9223372036854775808}}, '
            '"max_tokens": 1}',
            "16,777,216",
        ),
        ('{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 100000000000}', "16,777,216"),
        ('{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 1, "lora": "x"}', "'lora'"),
        ('{"id": "a", "prompt": {"history": "b"}, "max_tokens": 1}', "no earlier line"),
        (
            '{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 1, "after": "zz"}',
            "no earlier line",
        ),
        ("not json", "line 1: not valid JSON"),
        ("[1, 2]", "line 1: expected a JSON object"),
    ],
)
def test_bad_lines_name_line_and_field(text: str, fragment: str) -> None:
    with pytest.raises(WorkloadError, match=fragment):
        load_workload([text])


def test_duplicate_ids_and_line_numbers() -> None:
    good = '{"id": "a", "prompt": {"tokens": [1]}, "max_tokens": 1}'
    with pytest.raises(WorkloadError, match="line 3: field 'id': duplicate id 'a'"):
        load_workload([good, "", good])


def test_pressure_fills_the_geometry_it_is_sized_for() -> None:
    """Without --sequences, enough sequences to fill 1.5 × the pool: on hybrid-dcp4 (1,023
    usable blocks, an 8,192-token sequence leaves one attention page and one state) 768."""
    from kvreuse.sim.generators import fill_sequences

    assert fill_sequences("hybrid-dcp4", 8192) == 768
    assert fill_sequences("attention-16", 8192) == 24  # 8,191 blocks, 512 pages each
    assert len(pressure(None, 8192, 2, geometry="attention-16")) == 48


def test_random_tokens_are_deterministic() -> None:
    assert random_tokens(5, 100) == random_tokens(5, 100) != random_tokens(6, 100)
