"""Ordinary mistakes with the real command line (a subprocess each): one line on stderr, no
traceback, and the exit code that says what happened (2: the input; 130: Ctrl-C; 141: the
reader of stdout left)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvreuse.sim.generators import resend_grid, shared_prefix

KVREUSE = [sys.executable, "-m", "kvreuse"]


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVREUSE, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def one_error_line(proc: subprocess.CompletedProcess[str], code: int, fragment: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, lines
    assert fragment in lines[0], lines[0]
    return lines[0]


def write_jsonl(path: Path, objs: list[dict]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return path


def test_an_empty_workload(tmp_path: Path) -> None:
    wl = tmp_path / "empty.jsonl"
    wl.write_text("\n")
    proc = run("simulate", "--geometry", "hybrid-dcp4", str(wl), "--out", str(tmp_path / "o"))
    one_error_line(proc, 2, f"kvreuse simulate: {wl}: no requests")


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_out_that_cannot_be_written_is_refused_before_the_run(
    tmp_path: Path, where: str
) -> None:
    wl = write_jsonl(tmp_path / "w.jsonl", resend_grid([300]))
    blocker = tmp_path / "taken"
    blocker.write_text("not a directory")
    out = blocker if where == "a file" else blocker / "sub"
    proc = run("simulate", "--geometry", "hybrid-dcp4", str(wl), "--out", str(out), "--no-plots")
    one_error_line(proc, 2, f"--out {out}: ")
    assert blocker.read_text() == "not a directory"


def test_ctrl_c_stops_a_simulation_and_keeps_what_finished(tmp_path: Path) -> None:
    wl = write_jsonl(tmp_path / "w.jsonl", shared_prefix(1024, 1024, 20_000, max_tokens=64))
    out = tmp_path / "o"
    rows = out / "requests.jsonl"
    with subprocess.Popen(
        [*KVREUSE, "simulate", "--geometry", "hybrid-dcp4", str(wl), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        deadline = time.monotonic() + 120
        while (not rows.exists() or rows.stat().st_size == 0) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr
    summary = json.loads((out / "summary.json").read_text())
    done = summary["requests"]
    assert summary["interrupted"] and 0 < done < 20_000
    assert stderr.startswith(f"kvreuse simulate: interrupted after {done:,} of 20,000 requests")
    assert f"{out}/requests.jsonl" in stderr
    kept = [json.loads(x) for x in rows.read_text().splitlines()]
    assert len(kept) == done and all(r["finish_reason"] == "length" for r in kept)
    assert (
        (out / "report.md").read_text().startswith("# Simulation report: hybrid-dcp4 (interrupted)")
    )


@pytest.mark.parametrize(
    "args",
    [
        ("workload", "shared-prefix", "--requests", "200000"),
        ("demo", "--json", "--lengths", ",".join(map(str, range(1, 500)))),  # past a pipe
    ],
)
def test_output_piped_into_head(args: tuple[str, ...]) -> None:
    with subprocess.Popen(
        [*KVREUSE, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.readline()
        proc.stdout.close()  # what `| head -1` does after its line
        stderr = proc.stderr.read()
        assert proc.wait(timeout=120) == 141, stderr  # 128 + SIGPIPE, as a shell reports it
    assert stderr == ""


def _without(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment where `modules` cannot be imported (as in a core-only install)."""
    fake = tmp_path / "missing"
    for name in modules:
        (fake / name).mkdir(parents=True)
        (fake / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {name!r}'!r}, name={name!r})\n"
        )
    path = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


CORE_ONLY = (
    "tqdm", "matplotlib", "torch", "safetensors", "tokenizers", "fastapi", "uvicorn",
    "prometheus_client", "httpx", "rich", "openai",
)  # fmt: skip


def test_a_core_only_install_runs_demo_and_workload_and_names_the_extra_of_the_rest(
    tmp_path: Path,
) -> None:
    env = _without(tmp_path, *CORE_ONLY)
    assert run("demo", "--json", env=env).returncode == 0
    wl = tmp_path / "w.jsonl"
    proc = run("workload", "resend-grid", "--lengths", "300", env=env)
    assert proc.returncode == 0 and proc.stderr == ""
    wl.write_text(proc.stdout)
    proc = run(
        "simulate", "--geometry", "hybrid-dcp4", str(wl), "--out", str(tmp_path / "o"), env=env
    )
    one_error_line(
        proc, 2, "the plots need matplotlib, which is not installed: pip install -e '.[sim]'"
    )
    assert not (tmp_path / "o" / "requests.jsonl").exists()  # found before the run
    # without plots, and without a progress bar, the simulation itself needs nothing
    proc = run(
        "simulate",
        "--geometry",
        "hybrid-dcp4",
        str(wl),
        "--out",
        str(tmp_path / "o"),
        "--no-plots",
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    one_error_line(run("serve", "--fake", env=env), 2, "pip install -e '.[server]'")
    one_error_line(run("serve", env=env), 2, "pip install -e '.[")  # server, then engine
    one_error_line(
        run("qualify", "--fake", "--quick", "--out", str(tmp_path / "q"), env=env),
        2,
        "pip install -e '.[server]'",
    )


def test_bad_option_values_are_one_usage_line() -> None:
    for args, fragment in [
        (("demo", "--lengths", "abc"), "argument --lengths: comma-separated sizes: must be"),
        (("demo", "--lengths", "100000000000"), "in 1 … 1,048,576"),
        (("workload", "agent", "--turns", "0"), "argument --turns: must be an integer in 1"),
        (("workload", "pressure", "--geometry", "nope"), "unknown geometry 'nope'"),
        (("simulate", "--geometry", "hybrid-dcp4", "w.jsonl", "--out", "o",
          "--prefill-tokens-per-s", "nan"), "must be a finite number in [1, 1e+12], got 'nan'"),
        (("simulate", "--geometry", "hybrid-dcp4", "w.jsonl", "--out", "o",
          "--decode-step-s", "inf"), "must be a finite number in [0, 3600]"),
        (("simulate", "--geometry", "hybrid-dcp4", "w.jsonl", "--out", "o",
          "--draft-accept-rate", "1.5"), "in [0, 1]"),
        (("qualify", "--num-blocks", "1000000000"), "about 177.0 GB"),
    ]:  # fmt: skip
        one_error_line(run(*args), 2, fragment)


def test_geometry_mistakes_name_the_file_and_what_is_allowed(tmp_path: Path) -> None:
    wl = write_jsonl(tmp_path / "w.jsonl", resend_grid([300]))
    geo = tmp_path / "g.toml"
    geo.write_text('[cache]\nnum_blok = 64\n[[groups]]\nkind = "full"\nblock_size = 16\n')
    line = one_error_line(
        run("simulate", str(geo), str(wl), "--out", str(tmp_path / "o")), 2, str(geo)
    )
    assert "did you mean 'num_blocks'?" in line and "allowed: [" in line
    geo.write_text('[cache]\nnum_blocks = 64\n[[groups]]\nkind = "sliding"\nblock_size = 16\n')
    one_error_line(
        run("simulate", str(geo), str(wl), "--out", str(tmp_path / "o")),
        2,
        f"{geo}: group 0 (sliding) needs window",
    )


def test_version_geometry_presets_and_defaults_in_help() -> None:
    from importlib.metadata import version

    line = run("--version").stdout.strip()  # the version, then the core path in use
    assert line.startswith(f"kvreuse {version('kvreuse')}, ")
    assert ", native core (" in line or ", pure-Python core (" in line
    listed = run("geometry", "list").stdout.splitlines()
    assert any(line.startswith("hybrid-dcp4 ") and "full 2048×4 = 8192" in line for line in listed)
    shown = run("geometry", "show", "tiny-spec-drop")
    assert shown.returncode == 0 and "num_spec_tokens = 3" in shown.stdout
    from kvreuse.deployment import load_geometry, preset

    assert load_geometry(shown.stdout, "shown").cache == preset("tiny-spec-drop").cache
    one_error_line(run("geometry", "show", "nope"), 2, "unknown geometry 'nope'")
    for kind in ("resend-grid", "shared-prefix", "agent", "retrieval", "pressure"):
        text = run("workload", kind, "--help").stdout
        assert text.count("(default:") >= 3, kind
    text = " ".join(run("simulate", "--help").stdout.split())
    assert "(default: the geometry's [cost], else 20,000)" in text
    assert "(default: None)" not in text
