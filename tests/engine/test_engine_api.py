"""The offline API's conventions: what `generate` takes, vLLM's sampling defaults, saving an
`LLM`, models that do not match their geometry, and the speculative presets."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvreuse.engine import LLM, ModelConfig, SamplingParams, TinyModel, save_model
from kvreuse.engine.sampling import GREEDY


def test_a_string_is_one_prompt_not_one_per_character() -> None:
    llm = LLM(geometry="tiny-attention")
    outs = llm.generate("hello world", SamplingParams(temperature=0.0, max_tokens=2))
    assert len(outs) == 1 and outs[0].prompt_token_ids == list(b"hello world")
    ids = llm.generate([104, 105], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(ids) == 1 and ids[0].prompt_token_ids == [104, 105]
    both = llm.generate(["hi", [104, 105]], SamplingParams(temperature=0.0, max_tokens=2))
    assert [o.prompt_token_ids for o in both] == [[104, 105], [104, 105]]


def test_bad_prompts_are_refused_before_anything_is_queued() -> None:
    llm = LLM(geometry="tiny-attention")
    for bad, fragment in [
        (["ok", 5], "a prompt is a string or a list of token ids"),
        (["ok", [1, "2"]], "a prompt is a string or a list of token ids"),
        (["ok", [1, 10**6]], r"token id 1000000 is outside the model's vocabulary \[0, 257\)"),
        (["ok", ""], "empty prompt"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            llm.generate(bad, SamplingParams(max_tokens=2))
        assert not llm.scheduler.has_work()  # "ok" was not left behind in the queue
    with pytest.raises(ValueError, match="params must be SamplingParams"):
        llm.generate(["ok"], [{"max_tokens": 2}])  # type: ignore[list-item]


def test_sampling_defaults_are_vllm_s() -> None:
    sp = SamplingParams()
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k) == (16, 1.0, 1.0, 0)
    assert GREEDY.temperature == 0.0  # a request queued without SamplingParams decodes greedily
    for bad in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": "1"}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=5)  # type: ignore[arg-type]
    # unseeded sampling is still reproducible: the same engine seed gives the same tokens
    prompt = list(range(40, 140))
    runs = [LLM(geometry="tiny-attention", seed=4).generate(prompt)[0].token_ids for _ in "ab"]
    assert runs[0] == runs[1] and len(runs[0]) == 16


def test_save_model_takes_an_llm_or_says_what_it_needs(tmp_path: Path) -> None:
    llm = LLM(geometry="tiny-hybrid-dcp4", seed=3)
    path = save_model(llm, tmp_path / "m")
    again = LLM(model=str(path), geometry="tiny-hybrid-dcp4")
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    assert again.generate("abc", sp)[0].token_ids == llm.generate("abc", sp)[0].token_ids
    with pytest.raises(ValueError, match="save_model takes a TinyModel or an LLM"):
        save_model("tiny", tmp_path / "x")


def test_a_model_without_a_layer_for_a_group_of_its_geometry_is_refused(tmp_path: Path) -> None:
    """An attention-only model on a hybrid geometry: the recurrent group would be allocated,
    hashed and reported as reused while no layer writes it."""
    path = save_model(TinyModel.random(ModelConfig(layer_types=("full", "full")), 1), tmp_path)
    with pytest.raises(ValueError, match="has no 'recurrent' layer"):
        LLM(model=str(path), geometry="tiny-hybrid-dcp4")
    hybrid = ModelConfig(layer_types=("full", "recurrent"))
    path = save_model(TinyModel.random(hybrid, 1), tmp_path / "hybrid")
    with pytest.raises(ValueError, match="no draft head"):
        LLM(model=str(path), geometry="tiny-spec-drop")


def test_the_spec_presets_speculate_by_default() -> None:
    llm = LLM(geometry="tiny-spec-drop")
    assert (llm.runner.spec, llm.scheduler.config.num_spec_tokens) == ("eagle", 3)
    llm.generate(list(range(10, 60)), SamplingParams(temperature=0.0, max_tokens=8))
    assert llm.runner.num_drafted > 0
    off = LLM(geometry="tiny-spec-drop", num_spec_tokens=0)
    assert (off.runner.spec, off.scheduler.config.num_spec_tokens) == (None, 0)
    assert LLM(geometry="tiny-spec-lookahead", spec="ngram").scheduler.config.num_spec_tokens == 3


def test_the_embedded_model_takes_the_geometry_s_context_length() -> None:
    llm = LLM(geometry="tiny-hybrid-dcp4")
    assert llm.max_model_len == llm.model.config.max_position_embeddings == 16384
