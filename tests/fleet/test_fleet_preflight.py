"""`kvreuse fleet --model DIR` finds what its replicas would refuse before it starts any: a
missing or incomplete model directory, weights that do not match their config, a model whose
layers do not serve the geometry. One line, exit 2, no replica process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvreuse.cli import main

pytest.importorskip("torch", reason="a model directory needs torch: pip install -e '.[engine]'")
pytest.importorskip("fastapi", reason="kvreuse fleet needs the server: pip install -e '.[server]'")


@pytest.fixture
def no_replica_starts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    started: list[str] = []
    from kvreuse.fleet.serving import replicas

    def start(self: replicas.ReplicaProcess) -> None:
        started.append(self.name)
        raise AssertionError("a replica started before the checks")

    monkeypatch.setattr(replicas.ReplicaProcess, "start", start)
    return started


def _attention_only_model(tmp_path: Path) -> Path:
    from kvreuse.engine import LLM, save_model

    return save_model(LLM(geometry="tiny-attention"), tmp_path / "attn")


def _cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    empty = tmp_path / "empty"
    empty.mkdir()
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    attn = _attention_only_model(tmp_path)
    (no_weights / "config.json").write_text((attn / "config.json").read_text())
    bad = tmp_path / "bad-config"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"hidden_size": "wide"}))
    return [
        (["--model", str(tmp_path / "my-model")], "not a model directory"),
        (["--model", str(empty)], "config.json: missing"),
        (["--model", str(bad)], "hidden_size"),
        (["--model", str(no_weights)], "model.safetensors: missing"),
        (["--model", str(attn)], "but the model has no 'recurrent' layer"),
    ]


def test_a_bad_model_is_refused_before_any_replica_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_replica_starts: list[str]
) -> None:
    for extra, fragment in _cases(tmp_path):
        code = main(["fleet", "--replicas", "3", "--port", "0", *extra])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and fragment in err[0], (extra, err)
        assert err[0].startswith("kvreuse fleet: ")
    assert no_replica_starts == []


def test_a_model_that_fits_its_geometry_passes_the_checks(tmp_path: Path) -> None:
    from kvreuse.deployment import resolve
    from kvreuse.fleet.serving.preflight import check_model
    from kvreuse.tokenizer import ByteTokenizer

    attn = _attention_only_model(tmp_path)
    check_model(str(attn), False, resolve("tiny-attention"), ByteTokenizer())
    with pytest.raises(ValueError, match="no 'recurrent' layer"):
        check_model(str(attn), False, resolve("tiny-hybrid-dcp4"), ByteTokenizer())
