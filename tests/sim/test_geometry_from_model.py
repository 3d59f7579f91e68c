"""`kvreuse geometry from-model DIR` and `--geometry DIR`: a checkpoint's config.json, written by
`transformers`' own config classes, gives the groups, windows and state sizes its layers imply,
and the simulator runs on them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvreuse.deployment import load_geometry, resolve
from kvreuse.hfconfig import GeometryOptions, model_geometry, read_model_spec
from kvreuse.sim.generators import resend_grid

transformers = pytest.importorskip(
    "transformers", reason="needs transformers' config classes: pip install -e '.[test]'"
)

KVREUSE = [sys.executable, "-m", "kvreuse"]


def _granite(directory: Path) -> Path:
    transformers.GraniteMoeHybridConfig(
        vocab_size=320,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        mamba_n_heads=4,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        max_position_embeddings=4096,
    ).save_pretrained(str(directory))
    return directory


def _gemma3(directory: Path) -> Path:
    transformers.Gemma3TextConfig(
        vocab_size=320,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=6,
        sliding_window=48,
        max_position_embeddings=4096,
    ).save_pretrained(str(directory))
    return directory


def test_groups_and_state_sizes_follow_the_config(tmp_path: Path) -> None:
    spec = read_model_spec(_granite(tmp_path / "granite"))
    assert spec.layers_of("recurrent") == [0, 2, 3] and spec.layers_of("full") == [1]
    inner = 2 * 64  # mamba_expand 2 × hidden
    conv_dim = inner + 2 * 2 * 16  # x, then B and C per group
    assert spec.states[0] == (("conv", (3, conv_dim)), ("ssm", (4, 16, inner // 4)))
    assert spec.state_numel(0) == 3 * conv_dim + 4 * 16 * 32
    dep = load_geometry(model_geometry(tmp_path / "granite", GeometryOptions(dcp_size=4)), "g")
    full, rec = dep.cache.geometry.groups
    assert (full.kind, full.page_size, full.sharded) == ("full", 64, True)
    assert (rec.kind, rec.page_size) == ("recurrent", 64)  # M defaults to one attention page
    assert dep.cache.geometry.hash_unit == 16

    gemma = _gemma3(tmp_path / "gemma")
    kinds = read_model_spec(gemma).layer_kinds  # transformers' default: 5 sliding, then 1 full
    assert kinds == ("sliding",) * 5 + ("full",)
    groups = resolve(gemma).cache.geometry.groups  # a model directory as a geometry
    assert [(g.kind, g.window) for g in groups] == [("full", None), ("sliding", 48)]


def test_the_command_prints_a_geometry_simulate_runs(tmp_path: Path) -> None:
    model = _granite(tmp_path / "granite")
    proc = subprocess.run(
        [*KVREUSE, "geometry", "from-model", str(model), "--dcp", "2", "--num-blocks", "600"],
        capture_output=True,
        text=True,
        check=True,
    )
    text = proc.stdout
    assert "# layers 0, 2, 3: mamba2 state (conv 3 × 192; ssm 4 × 16 × 32)" in text
    state_bytes = (3 * 192 + 4 * 16 * 32) * 4
    assert f"{state_bytes:,} bytes per layer" in text and math.isfinite(state_bytes)
    geo = tmp_path / "granite.toml"
    geo.write_text(text)
    wl = tmp_path / "w.jsonl"
    wl.write_text("".join(json.dumps(o) + "\n" for o in resend_grid([100, 200], 4)))
    out = tmp_path / "out"
    for geometry in (str(geo), str(model)):
        sim = subprocess.run(
            [*KVREUSE, "simulate", geometry, str(wl), "--out", str(out), "--no-plots"],
            capture_output=True,
            text=True,
        )
        assert sim.returncode == 0, sim.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert summary["reconciled"] and summary["hits"] > 0


def test_a_directory_without_a_supported_config_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    proc = subprocess.run(
        [*KVREUSE, "geometry", "from-model", str(tmp_path / "m")], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert "model_type 'llama' is not supported" in proc.stderr
