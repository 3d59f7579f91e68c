"""Checkpoints and tokenizers: round trips are exact; bad files say why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvreuse.engine import (
    LLM,
    ByteTokenizer,
    HFTokenizer,
    ModelConfig,
    SamplingParams,
    TinyModel,
    load_model,
    save_model,
)

CFG = ModelConfig(layer_types=("full", "sliding", "recurrent"), sliding_window=48, draft_head=True)
TOKENS = list(range(3, 90))


def _saved(tmp_path: Path) -> tuple[TinyModel, Path]:
    model = TinyModel.random(CFG, seed=5)
    return model, save_model(model, tmp_path / "m")


def test_round_trip_gives_identical_logits(tmp_path: Path) -> None:
    model, path = _saved(tmp_path)
    loaded = load_model(path)
    assert loaded.config == CFG
    assert torch.equal(model.dense_logits(TOKENS), loaded.dense_logits(TOKENS))


def test_llm_loads_a_saved_default_model(tmp_path: Path) -> None:
    ref = LLM(geometry="tiny-hybrid-dcp4", seed=11)
    path = save_model(ref.model, tmp_path / "tiny")
    llm = LLM(model=str(path), geometry="tiny-hybrid-dcp4")
    assert llm.model_name == "tiny"
    sp = SamplingParams(temperature=0.0, max_tokens=5)
    assert llm.generate([TOKENS], sp)[0].token_ids == ref.generate([TOKENS], sp)[0].token_ids


def test_seeded_init_is_deterministic() -> None:
    a, b = TinyModel.random(CFG, 1), TinyModel.random(CFG, 1)
    assert all(torch.equal(a.w[k], b.w[k]) for k in a.w)
    assert not torch.equal(
        a.w["embed_tokens.weight"], TinyModel.random(CFG, 2).w["embed_tokens.weight"]
    )


def test_corrupt_weights_file(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupt"):
        load_model(path)


def test_mismatched_and_missing_tensors(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    f = path / "model.safetensors"
    weights = load_file(str(f))
    weights["norm.weight"] = torch.ones(7)
    save_file(weights, str(f))
    with pytest.raises(ValueError, match=r"norm\.weight has shape \(7,\)"):
        load_model(path)
    del weights["norm.weight"]
    save_file(weights, str(f))
    with pytest.raises(ValueError, match=r"missing tensor.*norm\.weight"):
        load_model(path)
    weights["norm.weight"] = torch.ones(64)
    weights["extra.weight"] = torch.ones(2)
    save_file(weights, str(f))
    with pytest.raises(ValueError, match=r"unexpected tensor.*extra\.weight"):
        load_model(path)


def test_config_mismatch_and_bad_config(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with pytest.raises(ValueError, match="shape"):
        load_model(path)
    (path / "config.json").write_text(json.dumps({**cfg, "layer_types": ["mamba"]}))
    with pytest.raises(ValueError, match="layer_types"):
        load_model(path)
    (path / "config.json").write_text(json.dumps({**cfg, "colour": 1}))
    with pytest.raises(ValueError, match="unknown key"):
        load_model(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        load_model(path)
    (path / "config.json").unlink()
    with pytest.raises(ValueError, match=r"config\.json"):
        load_model(path)


def test_model_must_fit_the_geometry(tmp_path: Path) -> None:
    _, path = _saved(tmp_path)  # sliding layers with window 48
    with pytest.raises(ValueError, match="no 'sliding' group"):
        LLM(model=str(path), geometry="tiny-hybrid-dcp4")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "sliding_window": 32}))
    with pytest.raises(ValueError, match="sliding_window 32"):
        LLM(model=str(path), geometry="tiny-sliding-hybrid")


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_id == 256 and tok.decode([256, 104]) == "h"


def test_hf_tokenizer_from_tokenizer_json(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    file = tmp_path / "tokenizer.json"
    hf.save(str(file))
    tok = HFTokenizer(file)
    assert tok.encode("hello world") == [2, 3]
    assert tok.eos_token_id == 1 and tok.vocab_size == 4
    llm = LLM(geometry="tiny-attention", tokenizer=str(file))
    assert llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=2))[
        0
    ].prompt_token_ids == [2, 3]
    file.write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        HFTokenizer(file)
