"""Every RoPE layout `transformers` writes, read by the engine and checked against
`transformers`' own forward.

Each family's tiny checkpoint is built with `transformers` 5 and a RoPE that is not the
default (linear scaling, another base, Qwen3-Next a half-rotated head, Granite with RoPE on),
saved, and read back by the engine in three layouts of config.json:

* as saved: transformers 5's `rope_parameters` (Gemma 3: nested per layer type);
* rewritten into transformers 4's layout: top-level `rope_theta` (Gemma 3: and
  `rope_local_base_freq`), `rope_scaling` with `type` or `rope_type`, a top-level
  `partial_rotary_factor`, and the older spellings of the layer pattern and of LFM2's sizes;
* transformers 4's layout with the scaling dropped: the engine must then differ from
  `transformers` by far more than the tolerance, so agreement above is not an accident of RoPE
  barely mattering on these prompts.

Rope types the engine does not compute (yarn, dynamic, longrope, llama3) are refused in one
line naming the field, in either layout.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face layout tests need transformers: pip install -e '.[test]'",
)

from hf_tiny import build, hf_logits  # noqa: E402

from kvreuse.engine import LLM, SamplingParams  # noqa: E402
from kvreuse.engine.hf import load_hf_model  # noqa: E402
from kvreuse.hfconfig import CheckpointError  # noqa: E402

TOL = 1e-3
# positions up to 60: far enough for a linear factor and another base to move the logits
_RNG = random.Random(5)
PROMPT = [_RNG.randrange(256) for _ in range(60)]

# family -> the non-default RoPE its checkpoint is built with (transformers 5's layout)
ROPE: dict[str, dict[str, Any]] = {
    "granite": {
        "position_embedding_type": "rope",
        "rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 3000.0},
    },
    "gemma3": {
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 20000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        }
    },
    "lfm2": {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0}},
    "qwen3_next": {
        "rope_parameters": {
            "rope_type": "linear",
            "factor": 8.0,
            "rope_theta": 1000.0,
            "partial_rotary_factor": 0.5,
        },
        "partial_rotary_factor": 0.5,
    },
}
FAMILIES = list(ROPE)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("hf-layouts")
    return {
        f: (root / f, build(f, root / f, seed=20 + i, **ROPE[f])) for i, f in enumerate(FAMILIES)
    }


def v4_layout(config: dict[str, Any], scaling_key: str = "type") -> dict[str, Any]:
    """config.json as transformers 4 wrote it: RoPE at the top level (`rope_theta`,
    `rope_scaling` keyed `scaling_key`, `partial_rotary_factor`; Gemma 3's sliding base as
    `rope_local_base_freq`), no `layer_types` but each family's older way to say it, and LFM2's
    older names for its MLP width and tied embeddings."""
    c = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types", "dtype")}
    c["transformers_version"], c["torch_dtype"] = "4.55.0", config["dtype"]
    rope = config["rope_parameters"]
    if c["model_type"] == "gemma3_text":
        rope, c["rope_local_base_freq"] = (
            rope["full_attention"],
            rope["sliding_attention"]["rope_theta"],
        )
    c["rope_theta"] = rope["rope_theta"]
    c["rope_scaling"] = (
        {scaling_key: rope["rope_type"], "factor": rope["factor"]}
        if rope["rope_type"] != "default"
        else None
    )
    types = config["layer_types"]
    if c["model_type"] == "gemma3_text":  # [s, s, f, s]: every third layer is full
        del c["_sliding_window_pattern"]
        c["sliding_window_pattern"] = 3
    elif c["model_type"] == "qwen3_next":  # [l, l, l, f]: every fourth
        c["full_attention_interval"] = 4
    elif c["model_type"] == "lfm2":
        c["full_attn_idxs"] = [i for i, t in enumerate(types) if t == "full_attention"]
        c["block_ff_dim"] = c.pop("intermediate_size")
        c["tie_embedding"] = c.pop("tie_word_embeddings")
    else:  # Granite's older name, with the older layer names
        names = {"linear_attention": "mamba", "full_attention": "attention"}
        c["layers_block_type"] = [names[t] for t in types]
    return c


def _copy(src: Path, dst: Path, config: dict[str, Any]) -> Path:
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _max_diff(directory: Path, ref: Any) -> float:
    got = load_hf_model(directory).dense_logits(PROMPT)
    return (got - hf_logits(ref, PROMPT)).abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_every_rope_layout_matches_transformers(
    family: str, checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    directory, ref = checkpoints[family]
    saved = json.loads((directory / "config.json").read_text())
    assert "rope_scaling" not in saved and "rope_parameters" in saved  # transformers 5 wrote it
    assert _max_diff(directory, ref) <= TOL
    for key in ("type", "rope_type"):
        old = v4_layout(saved, key)
        assert "rope_parameters" not in old and "layer_types" not in old
        assert _max_diff(_copy(directory, tmp_path / f"v4-{key}", old), ref) <= TOL, key
    unscaled = {**v4_layout(saved), "rope_scaling": None}
    assert _max_diff(_copy(directory, tmp_path / "unscaled", unscaled), ref) > 100 * TOL


def test_a_transformers_4_checkpoint_serves_through_llm(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    """End to end on the paged cache: Gemma 3 in transformers 4's layout (linear × 8 on full
    attention, its own sliding base), greedy tokens and logits as `transformers` gives them."""
    directory, ref = checkpoints["gemma3"]
    saved = json.loads((directory / "config.json").read_text())
    old = _copy(directory, tmp_path / "gemma3-v4", v4_layout(saved, "rope_type"))
    llm = LLM(model=str(old), enable_caching=False)
    llm.runner.record_logits = True
    res = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=4))[0]
    want = hf_logits(ref, PROMPT + res.token_ids[:-1])[len(PROMPT) - 1 :]
    got = torch.stack(llm.runner.logits_log[res.request_id])
    assert torch.allclose(got, want, atol=TOL, rtol=0)
    assert res.token_ids == want.argmax(-1).tolist()


UNSUPPORTED = ["yarn", "dynamic", "longrope", "llama3", "su"]


def _refusal(directory: Path, config: dict[str, Any], tmp_path: Path, name: str) -> str:
    bad = _copy(directory, tmp_path / name, config)
    with pytest.raises(CheckpointError) as info:
        load_hf_model(bad)
    return str(info.value)


@pytest.mark.parametrize("rope_type", UNSUPPORTED)
def test_rope_types_the_engine_does_not_compute_are_refused(
    rope_type: str, checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    for family in ("lfm2", "gemma3"):
        directory, _ = checkpoints[family]
        saved = json.loads((directory / "config.json").read_text())
        new = json.loads(json.dumps(saved))
        entry = new["rope_parameters"]
        entry = entry["full_attention"] if family == "gemma3" else entry
        entry["rope_type"] = rope_type
        old = v4_layout(saved)
        old["rope_scaling"] = {"type": rope_type, "factor": 4.0}
        for layout, config, field in (
            ("v5", new, "rope_type"),
            ("v4", old, "rope_scaling.type"),
        ):
            message = _refusal(directory, config, tmp_path, f"{family}-{layout}")
            assert "\n" not in message and field in message and repr(rope_type) in message
            assert "default" in message and "linear" in message  # says what is allowed


@pytest.mark.parametrize(
    ("family", "change", "field"),
    [
        ("lfm2", {"rope_parameters": "linear"}, "rope_parameters"),
        ("lfm2", {"rope_parameters": None, "rope_scaling": {"rope_type": "linear"}}, "factor"),
        ("lfm2", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.factor"),
        ("lfm2", {"rope_theta": 5.0}, "rope_theta"),
        ("lfm2", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("gemma3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "nests"),
        ("qwen3_next", {"partial_rotary_factor": 0.25}, "partial_rotary_factor"),
        ("qwen3_next", {"rope_parameters": {"full_attention": {}}}, "rope_parameters"),
        ("granite", {"position_embedding_type": "alibi"}, "position_embedding_type"),
    ],
)
def test_rope_fields_that_disagree_or_mean_nothing_are_refused(
    family: str,
    change: dict[str, Any],
    field: str,
    checkpoints: dict[str, tuple[Path, Any]],
    tmp_path: Path,
) -> None:
    """A value given twice (rope_parameters and the transformers 4 fields) must agree; a
    layout the family does not have is refused rather than guessed at."""
    directory, _ = checkpoints[family]
    saved = json.loads((directory / "config.json").read_text())
    message = _refusal(directory, {**saved, **change}, tmp_path, "bad")
    assert "\n" not in message and field in message
