"""`kvreuse sweep`: capacities, the pool each case gets, the outputs, the errors, and per-case
results equal to the same cases run one by one with `kvreuse simulate`."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from kvreuse.cli import main
from kvreuse.deployment import geometry_toml, load_geometry, preset
from kvreuse.sim import sweep, sweep_cli
from kvreuse.sim.generators import agent, shared_prefix
from kvreuse.sim.sweep import Case, parse_capacities, percentile
from kvreuse.sim.workload import load_workload
from kvreuse.vocab import exact_size

PNG = b"\x89PNG\r\n\x1a\n"


def _workload(tmp_path: Path) -> Path:
    """Two agent sessions and a shared-prefix burst: reuse that small pools lose."""
    objs = agent(2, 4, user_len=600, tool_len=1200, max_tokens=16)
    objs += shared_prefix(prefix_len=3000, suffix_len=64, requests=4)
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def test_capacities_are_decimal_token_counts() -> None:
    assert parse_capacities("1M,3M,10M,50M,inf") == [10**6, 3 * 10**6, 10**7, 5 * 10**7, None]
    assert parse_capacities(" 1.5k , 2G,8192, unlimited") == [1500, 2 * 10**9, 8192, None]
    assert [exact_size(c) for c in (10**6, 1500, 2 * 10**9, 8192, None)] == [
        "1M",
        "1.5K",
        "2G",
        "8.192K",
        "inf",
    ]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("3X", "capacity must be a whole number in 1 … 1,000T"),
        ("0", "capacity must be a whole number in 1 … 1,000T"),
        ("-1M", "capacity must be a whole number in 1 … 1,000T"),
        ("1e6", "capacity must be a whole number in 1 … 1,000T"),
        ("1M,,2M", "capacity must be a whole number .*, got ''"),
        ("2000T", "capacity must be a whole number in 1 … 1,000T"),
        ("1M,1000k", "capacity '1000k' is given twice"),
        ("inf,unlimited", "capacity 'unlimited' is given twice"),
    ],
)
def test_a_bad_capacity_is_one_line(text: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment) as info:
        parse_capacities(text)
    assert "\n" not in str(info.value)


def test_a_capacity_becomes_the_pool_a_geometry_file_asks_for(tmp_path: Path) -> None:
    workload = load_workload(_workload(tmp_path).read_text().splitlines())
    geometries = [("attention-16", preset("attention-16")), ("hybrid-dcp4", preset("hybrid-dcp4"))]
    cases = sweep.cases_for(geometries, [10**6, None], workload)
    blocks = [c.deployment.cache.num_blocks for c in cases]
    # 16-token pages: 62,500 of them, and the null block; 8,192-token pages: 123, plus the
    # recurrent group's live and scratch slots (κ = 0), and the null block
    assert blocks[0] == 1 + 10**6 // 16 and blocks[2] == 1 + 123 + 2
    assert [c.capacity for c in cases] == [10**6, None, 10**6, None]
    for label, geo in geometries:  # what a geometry file with capacity_tokens = 1,000,000 gets
        text = geometry_toml(geo).replace(
            f"num_blocks = {geo.cache.num_blocks}", "capacity_tokens = 1000000"
        )
        filed = load_geometry(text)
        assert filed.cache.num_blocks in blocks, label


def test_unlimited_never_evicts_and_a_small_pool_does(tmp_path: Path) -> None:
    wl = _workload(tmp_path)
    out = tmp_path / "o"
    code = main(
        [
            "sweep", str(wl), "--geometry", "attention-16", "--geometry", "hybrid-dcp4",
            "--capacity", "10K,inf", "--out", str(out), "--jobs", "1", "--no-plots", "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    rows = {(r["geometry"], r["capacity_tokens"]): r for r in _cases(out)}
    for geometry in ("attention-16", "hybrid-dcp4"):
        small, unlimited = rows[geometry, 10_000], rows[geometry, None]
        assert unlimited["evicted_blocks"] == 0 < small["evicted_blocks"]
        assert unlimited["cached_tokens"] > small["cached_tokens"]
        assert unlimited["reconciled"] and small["reconciled"]


def _cases(out: Path) -> list[dict]:
    return json.loads((out / "sweep.json").read_text())["cases"]


def _simulate_alone(tmp_path: Path, wl: Path, row: dict, i: int) -> tuple[dict, list[float]]:
    """The case as `kvreuse simulate GEOMETRY.toml WORKLOAD`: the preset with the case's pool."""
    dep = preset(row["geometry"])
    geo = tmp_path / f"case{i}.toml"
    sized = replace(dep, cache=replace(dep.cache, num_blocks=row["num_blocks"]))
    geo.write_text(geometry_toml(sized))
    out = tmp_path / f"alone{i}"
    argv = ["simulate", str(geo), str(wl), "--out", str(out), "--no-plots", "--no-compare"]
    assert main([*argv, "--quiet"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "requests.jsonl").read_text().splitlines()
    ttft = sorted(r["ttft_estimate_s"] for r in map(json.loads, lines))
    return summary, ttft


def test_a_parallel_sweep_equals_the_cases_run_one_by_one(tmp_path: Path) -> None:
    wl = _workload(tmp_path)
    out = tmp_path / "sweep"
    code = main(
        [
            "sweep", str(wl), "--geometry", "attention-16", "--geometry", "hybrid-dcp4",
            "--capacity", "20K,inf", "--out", str(out), "--jobs", "2", "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    rows = _cases(out)
    assert [(r["geometry"], r["capacity_tokens"]) for r in rows] == [
        ("attention-16", 20_000),
        ("attention-16", None),
        ("hybrid-dcp4", 20_000),
        ("hybrid-dcp4", None),
    ]
    for i, row in enumerate(rows):
        s, ttft = _simulate_alone(tmp_path, wl, row, i)
        assert (row["cached_tokens"], row["prompt_tokens"], row["hit_rate"]) == (
            s["hits"],
            s["queries"],
            s["hit_rate"],
        )
        assert (row["prefill_tokens"], row["preemptions"], row["evicted_blocks"]) == (
            s["prefill_tokens_computed"],
            s["preemptions"],
            s["evicted_blocks"],
        )
        assert row["simulated_seconds"] == s["simulated_seconds"]
        assert [row[f"ttft_p{q}_s"] for q in (50, 90, 99)] == [
            percentile(ttft, q) for q in (50, 90, 99)
        ]
    for name in ("hit_rate_vs_capacity.png", "prefill_time.png"):
        assert (out / name).read_bytes()[:8] == PNG
    report = (out / "sweep.md").read_text()
    assert "| attention-16 | 20K" in report and "![prefill_time.png](prefill_time.png)" in report
    doc = json.loads((out / "sweep.json").read_text())
    # the sweep's own time: the cases ran two at a time, so no more than their sum (and a bit)
    assert 0 < doc["elapsed_s"] <= sum(r["wall_s"] for r in rows) + 5
    assert doc["cases_per_s"] == pytest.approx(4 / doc["elapsed_s"], rel=0.05)


def test_a_sweep_says_how_fast_it_went(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sweep", str(_workload(tmp_path)), "--geometry", "attention-16", "--capacity",
                 "inf", "--out", str(tmp_path / "o"), "--jobs", "1", "--no-plots"])  # fmt: skip
    assert code == 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("kvreuse sweep: 1 case in ") and last.endswith(" cases/s)")


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert [percentile(values, q) for q in (50, 90, 99, 100)] == [50.0, 90.0, 99.0, 100.0]
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--geometry", "nope"], "unknown geometry 'nope'"),
        (["--geometry", "attention-16", "--geometry", "attention-16"], "given twice"),
        (["--geometry", "attention-16", "--capacity", "1Q"], "capacity must be a whole number"),
        (["--geometry", "attention-16", "--draft-accept-rate", "2"], "--draft-accept-rate"),
        (["--geometry", "attention-16", "--capacity", "10G"], "attention-16 at capacity 10G: "),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], fragment: str
) -> None:
    wl = _workload(tmp_path)
    try:
        code = main(["sweep", str(wl), "--out", str(tmp_path / "o"), "--quiet", *extra])
    except SystemExit as exc:  # refused as the option is read
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("kvreuse sweep: ") and fragment in err and err.count("\n") == 1


def test_a_missing_workload_or_an_unusable_out_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--geometry", "attention-16", "--quiet"]
    assert main(["sweep", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o"), *args]) == 2
    assert "cannot read the workload file" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["sweep", str(_workload(tmp_path)), "--out", str(blocker), *args]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err


def test_ray_without_the_package_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sweep_cli, "find_spec", lambda name: None)  # as if not installed
    wl = _workload(tmp_path)
    code = main(["sweep", str(wl), "--geometry", "attention-16", "--out", str(tmp_path), "--ray"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--ray needs the ray package" in err and "pip install 'kvreuse[ray]'" in err


def test_a_case_that_cannot_run_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    geo = tmp_path / "short.toml"
    geo.write_text(
        geometry_toml(preset("attention-16")).replace(
            "[[groups]]", "max_model_len = 64\n[[groups]]", 1
        )
    )
    code = main(["sweep", str(_workload(tmp_path)), "--geometry", str(geo), "--capacity", "inf",
                 "--out", str(tmp_path / "o"), "--quiet", "--no-plots"])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert f"kvreuse sweep: {geo} at capacity inf: " in err and "max_model_len" in err


def test_requests_larger_than_a_capacity_exit_1_naming_the_case(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["sweep", str(_workload(tmp_path)), "--geometry", "attention-16", "--capacity",
                 "2K,inf", "--out", str(tmp_path / "o"), "--quiet", "--no-plots"])  # fmt: skip
    assert code == 1
    assert "requests exceed the cache in attention-16 at 2K (" in capsys.readouterr().err
    rows = _cases(tmp_path / "o")
    assert rows[0]["too_large"] > 0 and rows[1]["too_large"] == 0


def test_ctrl_c_keeps_the_finished_cases(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = sweep.run_case

    def second_is_interrupted(case: Case, workload: list, rate: float) -> dict:
        if case.capacity is None:
            raise KeyboardInterrupt
        return real(case, workload, rate)

    monkeypatch.setattr(sweep, "run_case", second_is_interrupted)
    out = tmp_path / "o"
    code = main(["sweep", str(_workload(tmp_path)), "--geometry", "attention-16", "--capacity",
                 "20K,inf", "--out", str(out), "--jobs", "1", "--quiet"])  # fmt: skip
    assert code == 130
    assert "interrupted after 1 of 2 cases" in capsys.readouterr().err
    doc = json.loads((out / "sweep.json").read_text())
    assert doc["interrupted"] and [r["capacity_tokens"] for r in doc["cases"]] == [20_000]
    assert not (out / "prefill_time.png").exists()


RAY_PYTHON = Path(__file__).resolve().parents[2] / ".venv-ray" / "bin" / "python"
RAY_SETUP = "bash benchmarks/ray/setup_venv.sh"


@pytest.mark.needs(
    RAY_PYTHON.exists(), "Ray's venv (.venv-ray)", "bash benchmarks/ray/setup_venv.sh"
)
def test_a_sweep_on_ray_equals_the_local_one(tmp_path: Path) -> None:
    """The sweep's cases as Ray tasks on a local cluster (in the Ray venv, where Ray is), row
    for row the local run's."""
    wl = _workload(tmp_path)
    base = ["sweep", str(wl), "--geometry", "attention-16", "--capacity", "20K,inf", "--quiet"]
    assert main([*base, "--out", str(tmp_path / "local"), "--jobs", "1", "--no-plots"]) == 0
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local cluster
    cmd = [str(RAY_PYTHON), "-m", "kvreuse", *base, "--out", str(tmp_path / "ray"), "--ray"]
    proc = subprocess.run(
        [*cmd, "--no-plots"], capture_output=True, text=True, timeout=600, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    strip = [{k: v for k, v in r.items() if k != "wall_s"} for r in _cases(tmp_path / "local")]
    assert strip == [
        {k: v for k, v in r.items() if k != "wall_s"} for r in _cases(tmp_path / "ray")
    ]
