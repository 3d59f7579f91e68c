"""One way to write a size: every option that takes tokens or blocks reads `3M`, `1.5G`, `8K`
and (where it allows one) `inf` the same way, and refuses anything else in one line; and a
workload whose requests do not fit the pool is told so before the run, with the capacity that
fits them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvreuse.cli import main
from kvreuse.deployment import preset
from kvreuse.sim.fit import check_fit
from kvreuse.sim.run import simulate
from kvreuse.sim.workload import load_workload
from kvreuse.vocab import exact_size, parse_size, parse_sizes, percent, plural, size_at_least

DATA = Path(__file__).parents[1] / "data"


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("1_000", 1000),
        ("3M", 3_000_000),
        ("3m", 3_000_000),
        ("1.5G", 1_500_000_000),
        ("8K", 8000),
        (" 2 T ", 2 * 10**12),
        (".5K", 500),
    ],
)
def test_a_size_is_read_the_same_everywhere(text: str, value: int) -> None:
    assert parse_size(text, 1, 10**15) == value


@pytest.mark.parametrize("text", ["0", "-1", "1.5", "1.0005K", "3X", "M", "", "nan", "1e6"])
def test_a_size_that_is_not_a_whole_count_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="must be a whole number in 1"):
        parse_size(text, 1, 10**15)


def test_inf_only_where_the_option_allows_it() -> None:
    assert parse_size("inf", 1, 10, unlimited=True) is None
    assert parse_size("Unlimited", 1, 10, unlimited=True) is None
    with pytest.raises(ValueError, match="got 'inf'"):
        parse_size("inf", 1, 10)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def test_every_simulate_size_option_takes_suffixes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = tmp_path / "w.jsonl"
    assert main(["workload", "shared-prefix", "--prefix-len", "2K", "--requests", "4"]) == 0
    wl.write_text(capsys.readouterr().out)
    first = json.loads(wl.read_text().splitlines()[0])
    assert first["prompt"]["concat"][0]["random"]["len"] == 2000  # K is 10^3, as in --capacity
    base = ["simulate", "--geometry", "attention-16", str(wl), "--no-plots", "--quiet", "--json"]
    for flag, short, long in (
        ("--capacity-tokens", "3.5K", "3500"),
        ("--num-blocks", "2K", "2000"),
    ):
        a, b = tmp_path / f"{flag}-a", tmp_path / f"{flag}-b"
        assert _run([*base, "--out", str(a), flag, short], capsys)[0] == 0
        assert _run([*base, "--out", str(b), flag, long], capsys)[0] == 0
        assert _summary(a)["capacity_tokens"] == _summary(b)["capacity_tokens"]
    code, err = _run(
        [*base, "--out", str(tmp_path / "t"), "--replicas", "2", "--store-capacity", "1M"],
        capsys,
    )
    assert code == 0, err
    fleet = json.loads((tmp_path / "t" / "fleet.json").read_text())
    store = fleet["runs"][0]["tiers"]["store"]
    assert store["shared"] and store["capacity_blocks"] == -(-1_000_000 // 16)


def test_capacity_inf_is_a_pool_that_never_evicts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = tmp_path / "w.jsonl"
    assert main(["workload", "pressure", "--geometry", "attention-16", "--length", "4K"]) == 0
    wl.write_text(capsys.readouterr().out)
    base = ["simulate", "--geometry", "attention-16", str(wl), "--no-plots", "--quiet"]
    assert _run([*base, "--out", str(tmp_path / "d")], capsys)[0] == 0
    assert _summary(tmp_path / "d")["evicted_blocks"] > 0  # the pressure workload evicts
    assert _run([*base, "--out", str(tmp_path / "i"), "--capacity-tokens", "inf"], capsys)[0] == 0
    assert _summary(tmp_path / "i")["evicted_blocks"] == 0


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["simulate", "--capacity-tokens", "3X"], "--capacity-tokens: must be a whole number"),
        (["simulate", "--num-blocks", "inf"], "--num-blocks: must be a whole number"),
        (["sweep", "--capacity", "1M,1e6"], "capacity must be a whole number"),
        (["workload", "retrieval", "--length", "100.5"], "--length/--len: must be a whole number"),
        (["workload", "resend-grid", "--lengths", "1K,1000"], "'1000' is given twice"),
        (["serve", "--num-blocks", "1"], "--num-blocks: must be a whole number in 2"),
    ],
)
def test_a_bad_size_is_one_line(
    argv: list[str], fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wl = tmp_path / "w.jsonl"
    wl.write_text(json.dumps({"id": "a", "prompt": {"tokens": [1, 2]}, "max_tokens": 1}) + "\n")
    tail = {"simulate": [str(wl), "--geometry", "attention-16", "--out", str(tmp_path / "o")]}
    tail["sweep"] = [str(wl), "--geometry", "attention-16", "--out", str(tmp_path / "o")]
    try:
        code = main([*argv, *tail.get(argv[0], [])])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err


def test_a_preset_pool_too_small_for_the_workload_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default pool of a preset: one line with the capacity that fits, nothing simulated."""
    lines = [
        {"id": "big", "prompt": {"random": {"seed": 1, "len": 200_000}}, "max_tokens": 10},
        {"id": "small", "prompt": {"random": {"seed": 2, "len": 100}}, "max_tokens": 1},
    ]
    wl = tmp_path / "w.jsonl"
    wl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "o"
    base = ["simulate", "--geometry", "attention-16", str(wl), "--out", str(out), "--no-plots"]
    for extra in ([], ["--replicas", "2"]):
        code, err = _run([*base, "--quiet", *extra], capsys)
        assert code == 2 and not (out / "requests.jsonl").exists()
        assert err.splitlines() == [
            "kvreuse simulate: 1 of 2 requests can never fit attention-16's pool (8,192 blocks, "
            "131,056 tokens) and would be refused; the largest, big, holds 12,501 blocks at its "
            "peak: --capacity-tokens 201K fits every request (inf: a pool that never evicts)"
        ]
    code, err = _run([*base, "--quiet", "--capacity-tokens", "201K"], capsys)
    assert code == 0 and _summary(out)["too_large"]["count"] == 0


@pytest.mark.parametrize("name", ["attention-16", "hybrid-dcp4", "sliding-hybrid"])
def test_the_check_before_the_run_names_what_the_run_refuses(name: str) -> None:
    """The check's count is the scheduler's own: the same requests end `too_large`."""
    from dataclasses import replace

    dep = preset(name)
    page = max(g.page_size for g in dep.cache.geometry.groups if g.kind == "full")
    dep = replace(dep, cache=replace(dep.cache, num_blocks=12))
    lengths = [page * k + d for k in (1, 4, 8, 9, 10, 11, 12) for d in (-1, 0, 1)]
    wl = load_workload(
        json.dumps({"id": f"r{i}", "prompt": {"random": {"seed": i, "len": n}}, "max_tokens": 2})
        for i, n in enumerate(lengths)
    )
    fit = check_fit(dep, wl)
    refused = simulate(dep, wl).summary["too_large"]["count"]
    assert 0 < fit.num_too_large == refused


def test_an_exact_size_reads_back_as_itself() -> None:
    """Bounds in messages and the capacities a sweep names: the value, never rounded."""
    assert [exact_size(n) for n in (10**6, 1500, 8192, 2 * 10**9, 10**15, 2**24, 1_234_567)] == [
        "1M",
        "1.5K",
        "8.192K",
        "2G",
        "1,000T",
        "16,777,216",
        "1,234,567",
    ]
    assert exact_size(None) == "inf"
    for n in (0, 1, 999, 1000, 1001, 999_999, 1_050_000, 2**40, 2**63 - 1, 10**15 + 10**12):
        written = exact_size(n).replace(",", "")  # the separators are for reading only
        assert parse_size(written, 0, 2**63 - 1) == n, written


def test_comma_separated_sizes_are_read_one_way() -> None:
    """`--lengths`, `--capacity`: each item as a size; an empty or repeated one is refused."""
    assert parse_sizes(" 1.5k , 2G,8192, inf", 1, 10**15, unlimited=True) == [
        1500,
        2 * 10**9,
        8192,
        None,
    ]
    with pytest.raises(ValueError, match="got ''"):
        parse_sizes("1K,,2K", 1, 10**6)
    with pytest.raises(ValueError, match="'1000' is given twice"):
        parse_sizes("1K,1000", 1, 10**6)


@pytest.mark.parametrize(
    "argv",
    [
        ["simulate", "--geometry", "attention-16", "w.jsonl", "--out", "o"],
        ["serve", "--fake"],
        ["qualify"],
        ["fleet", "--replicas", "2", "--fake"],
        ["geometry", "from-model", "model"],
    ],
)
def test_num_blocks_is_read_one_way_by_every_command(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """One declaration: past the pool's ceiling, or below 2, one line at parse time."""
    for value, fragment in (
        ("1G", "--num-blocks: 1,000,000,000 blocks is too large: the pool's bookkeeping"),
        ("1", "--num-blocks: must be a whole number in 2 … 16,777,216"),
    ):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--num-blocks", value])
        err = capsys.readouterr().err.strip().splitlines()
        assert info.value.code == 2 and len(err) == 1 and fragment in err[0], err


def test_a_size_to_suggest_rounds_up() -> None:
    assert [size_at_least(n) for n in (163_839, 3_000_000, 900, 1001, 1_234_567_890)] == [
        "164K",
        "3M",
        "900",
        "1.01K",
        "1.24G",
    ]
    for n in (1, 999, 1001, 163_839, 999_999, 1_000_001, 87_570, 2**24, 10**9 + 1):
        assert parse_size(size_at_least(n), 1, 10**12) >= n  # a suggestion that suffices


def test_a_share_that_is_not_all_never_prints_as_100_percent() -> None:
    assert percent(32_752, 32_768) == "99.95%"
    assert percent(32_768, 32_768) == "100.0%"
    assert percent(1, 10**6) == "0.0001%"
    assert percent(0, 5) == "0.0%"
    assert percent(1, 3) == "33.3%"
    assert percent(1, 0) == "—"
    assert not math.isnan(float(percent(2, 3).rstrip("%")))


def test_counts_agree_with_their_nouns() -> None:
    assert [plural(1, "request"), plural(2, "request"), plural(1_024, "block")] == [
        "1 request",
        "2 requests",
        "1,024 blocks",
    ]


def test_the_import_summary_counts_in_words_that_agree(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One record of each kind the import reports: every count reads in the singular."""
    record = {
        "chat_id": 7,
        "parent_chat_id": 3,  # a session begun before the trace
        "timestamp": 1.0,
        "input_length": 40,
        "output_length": 0,
        "type": "text",
        "turn": 2,
        "hash_ids": [1],
    }
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(record) + "\n")
    assert main(["workload", "import", "bailian", str(trace)]) == 0
    err = capsys.readouterr().err
    assert err.strip() == (
        "kvreuse workload import bailian: wrote 1 request (40 prompt tokens) from 1 record; "
        "1 record has more input tokens than its hash ids cover; those tokens are unique to "
        "their request (shared with none); 1 record has output_length 0; each generates 1 "
        "token (a request generates at least one); 1 request names a parent_chat_id no earlier "
        "record has (a session begun before the trace); it waits for no one"
    )


def test_a_warm_resend_that_computes_its_last_page_is_not_100_percent() -> None:
    from kvreuse.sim.generators import retrieval
    from kvreuse.sim.report import kinds_table

    res = simulate(preset("attention-16"), load_workload(json.dumps(x) for x in retrieval(32_768)))
    warm = next(line for line in kinds_table(res) if line.startswith("doc-warm"))
    assert "32,752" in warm and "99.95%" in warm and "100.0%" not in warm
