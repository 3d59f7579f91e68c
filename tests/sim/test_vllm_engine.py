"""`kvreuse simulate --engine vllm`: vLLM's own scheduler and prefix cache as the engine.

In vLLM's venv (benchmarks/vllm/setup_venv.sh, which installs kvreuse there): on the README's
resend grid, on `hybrid-dcp4` and `attention-16`, every request's cached tokens are those of
an independent, minimal drive of vLLM's Scheduler (vllm_reference_driver.py, which imports
nothing of kvreuse), and the known divergence from kvreuse's engine is there (vLLM reuses less
of an appended prompt at P = 2,048 on hybrid-dcp4), so the test cannot pass on an engine that
reports nothing. In the main venv: what is refused, in one line, before anything runs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvreuse.deployment import preset
from kvreuse.sim.generators import resend_grid
from kvreuse.sim.run import simulate
from kvreuse.sim.workload import load_objects, tokens_of
from needs import missing

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm-anchor" / "bin" / "python"
DRIVER = Path(__file__).with_name("vllm_reference_driver.py")
SETUP = "bash benchmarks/vllm/setup_venv.sh"
LENGTHS = [255, 256, 257, 2047, 2048, 2049, 4096, 8191, 8192, 8193]  # the README's grid
# the presets as plain numbers for the reference (it reads no kvreuse geometry)
GEOMETRIES: dict[str, dict[str, Any]] = {
    "hybrid-dcp4": {
        "attention_block": 2048, "dcp": 4, "mamba_block": 256, "hash_unit": 256,
        "num_blocks": 1024,
    },
    "attention-16": {"attention_block": 16, "num_blocks": 8192},
}  # fmt: skip


def _kvreuse_in_vllm_venv() -> None:
    if not VLLM_PYTHON.exists():
        missing("vLLM 0.33.0's venv (.venv-vllm-anchor)", SETUP)
    probe = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import kvreuse; print(kvreuse.__file__)"],
        capture_output=True,
        text=True,
    )
    where = Path(probe.stdout.strip() or "/nonexistent").resolve()
    if probe.returncode or not where.is_relative_to(ROOT / "src"):
        missing("this checkout's kvreuse in vLLM's venv", SETUP)


def _grid(tmp_path: Path) -> Path:
    path = tmp_path / "grid.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in resend_grid(LENGTHS)))
    return path


def _cli(python: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, "-m", "kvreuse", "simulate", *args], capture_output=True, text=True, cwd=ROOT
    )


def _reference(geometry: str) -> dict[str, int]:
    lines = resend_grid(LENGTHS)
    requests = [
        [w.request_id, tokens_of(w.prompt, {}).tolist(), w.max_tokens]
        for w in load_objects(enumerate(lines, 1))
    ]
    longest = max(len(t) + m for _, t, m in requests)
    job = {"geometry": {**GEOMETRIES[geometry], "max_model_len": longest}, "requests": requests}
    proc = subprocess.run(
        [str(VLLM_PYTHON), str(DRIVER)], input=json.dumps(job), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    cached: dict[str, int] = json.loads(proc.stdout)
    return cached


def _kvreuse(geometry: str) -> dict[str, int]:
    workload = load_objects(enumerate(resend_grid(LENGTHS), 1))
    rows = simulate(preset(geometry), workload).requests
    return {r["id"]: r["cached_tokens"] for r in rows}


@pytest.mark.parametrize("geometry", sorted(GEOMETRIES))
def test_every_request_gets_vllms_own_cached_tokens(tmp_path: Path, geometry: str) -> None:
    _kvreuse_in_vllm_venv()
    out = tmp_path / "out"
    proc = _cli(
        str(VLLM_PYTHON), "--engine", "vllm", "--geometry", geometry, str(_grid(tmp_path)),
        "--out", str(out), "--no-plots", "--quiet", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engine"] == "vllm" and summary["reconciled"]
    assert "evicted_blocks" in summary["not_produced"]  # left out, and said so
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    engine = {r["id"]: r["cached_tokens"] for r in rows}
    assert [r["id"] for r in rows] == [line["id"] for line in resend_grid(LENGTHS)]
    assert engine == _reference(geometry)
    assert (out / "report.md").read_text().startswith(f"# Simulation report: {geometry} on vLLM")

    ours = _kvreuse(geometry)
    if geometry == "hybrid-dcp4":
        # the divergence the engine exists to show: vLLM's Mamba checkpoint of the resend
        # sits one hash block before the prompt's end, kvreuse's at it
        assert engine["appended-2048"] == 1792 < ours["appended-2048"] == 2048
        assert [engine[f"appended-{p}"] for p in (256, 2048, 4096, 8192)] == [0, 1792, 3840, 7936]
        assert sum(engine.values()) < sum(ours.values())
    else:
        assert engine == ours  # plain attention: the two caches agree
    assert any(engine.values())


def test_without_vllm_one_line_names_the_install_step(tmp_path: Path) -> None:
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vLLM is importable in this interpreter")
    proc = _cli(
        sys.executable, "--engine", "vllm", "--geometry", "attention-16", str(_grid(tmp_path)),
        "--out", str(tmp_path / "out"), "--no-plots",
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and SETUP in lines[0] and ".venv-vllm-anchor/bin/python" in lines[0]


CHUNKED = """
groups = [{kind = "full", block_size = 16}, {kind = "chunked", block_size = 16, chunk = 64}]
[cache]
num_blocks = 1024
"""


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--geometry", "tiny-spec-drop"], "spec_mode = 'drop'"),
        (["--geometry", "attention-16", "--host-capacity", "1M"], "--host-capacity"),
        (["--geometry", "attention-16", "--replicas", "2"], "--replicas"),
        (["--geometry", "attention-16", "--no-fast-forward"], "--no-fast-forward"),
        (["CHUNKED"], "group 1 (chunked)"),
    ],
)
def test_what_vllm_cannot_express_is_refused_in_one_line(
    tmp_path: Path, args: list[str], says: str
) -> None:
    if args == ["CHUNKED"]:
        (tmp_path / "chunked.toml").write_text(CHUNKED)
        args = [str(tmp_path / "chunked.toml")]
    out = tmp_path / "out"
    proc = _cli(sys.executable, "--engine", "vllm", *args, str(_grid(tmp_path)), "--out", str(out))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], lines
    assert not out.exists()  # refused before anything was written
