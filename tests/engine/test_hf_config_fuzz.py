"""Malformed Hugging Face checkpoints: each one either loads and then serves a request, or is
refused at load with one line (a ValueError, no newline, no traceback) that names the field.

The checkpoints are the tests' tiny ones (tests/engine/hf_tiny.py), with config.json mutated:
every field dropped, nulled, given a string, a list, an object, a bool, zero, a negative, a huge
or a fractional number, NaN, or a list nested in a list, plus RoPE types the engine does not
compute, and weights holding NaN or infinities. The cross product is large; a fixed sample of it
runs here, with every reported case besides. A config that declares a million layers or a hidden
size of 10⁹ is refused before anything is allocated (peak RSS of a fresh process).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face fuzz tests need transformers: pip install -e '.[test]'",
)

from hf_tiny import build  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from kvreuse.engine import LLM, SamplingParams  # noqa: E402

FAMILIES = ["granite", "gemma3", "lfm2", "qwen3_next"]
DROP = object()  # the mutation that removes the field
BAD: list[Any] = [
    DROP, None, "x", "", [1], {}, True, 0, -1, 10**9, 10**400, 0.5, 1e308, math.nan, [["x"]]
]  # fmt: skip
SAMPLE = 240  # cases of the cross product run here (all of them: about 2,000)
PROMPT = [104, 101, 108, 108, 111, 32, 119, 111]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-fuzz")
    for i, family in enumerate(FAMILIES):
        build(family, root / family, seed=i)
    return {f: root / f for f in FAMILIES}


def _config(directory: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads((directory / "config.json").read_text())
    return out


def _with(src: Path, dst: Path, config: dict[str, Any]) -> Path:
    """A copy of checkpoint `src` whose config.json is `config` (NaN written as JSON's NaN)."""
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def mutated(config: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = dict(config)
    if value is DROP:
        out.pop(key, None)
    else:
        out[key] = value
    return out


def outcome(directory: Path) -> str | None:
    """None when the checkpoint loads and serves a short greedy request; the refusal's message
    when loading raises a ValueError. Any other exception fails the test where it happens."""
    try:
        llm = LLM(model=str(directory), enable_caching=False)
    except ValueError as exc:
        return str(exc)
    res = llm.generate([PROMPT[: max(1, llm.max_model_len - 2)]], GREEDY)[0]
    assert len(res.token_ids) >= 1 and res.finish_reason in ("length", "stop")
    return None


GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


def check_refusal(message: str | None, *fields: str) -> None:
    """A refusal is one line that names (one of) the field(s); a load is fine too."""
    if message is None:
        return
    assert "\n" not in message and "Traceback" not in message, message
    assert any(f in message for f in fields), (fields, message)


def _cases(checkpoints: dict[str, Path]) -> list[tuple[str, str, Any]]:
    every = [
        (family, key, value)
        for family in FAMILIES
        for key in sorted(_config(checkpoints[family]))
        for value in BAD
    ]
    return random.Random(2024).sample(every, SAMPLE)


def test_mutated_fields_load_and_serve_or_are_refused_naming_the_field(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    for n, (family, key, value) in enumerate(_cases(checkpoints)):
        src = checkpoints[family]
        bad = _with(src, tmp_path / str(n), mutated(_config(src), key, value))
        check_refusal(outcome(bad), key)
        shutil.rmtree(bad)


# The cases users reported, each with the field its refusal must name (None: it must load and
# serve, as `transformers` runs it with the field's default).
REPORTED: list[tuple[str, str, Any, str | None]] = [
    ("gemma3", "intermediate_size", DROP, "intermediate_size"),
    ("lfm2", "intermediate_size", DROP, "intermediate_size"),
    ("qwen3_next", "intermediate_size", DROP, "intermediate_size"),
    ("qwen3_next", "layer_types", [["linear_attention"]] * 4, "layer_types"),
    ("gemma3", "layer_types", [["sliding_attention", "full_attention"]] * 4, "layer_types"),
    ("lfm2", "block_multiple_of", 0, "block_multiple_of"),
    ("gemma3", "rms_norm_eps", DROP, None),
    ("qwen3_next", "rms_norm_eps", DROP, None),
    ("lfm2", "rope_parameters", "default", "rope_parameters"),
    ("gemma3", "rope_parameters", "default", "rope_parameters"),
    ("gemma3", "query_pre_attn_scalar", 0, "query_pre_attn_scalar"),
    ("gemma3", "attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
    ("granite", "hidden_act", "gelu", "hidden_act"),
    ("qwen3_next", "num_experts_per_tok", 9, "num_experts_per_tok"),
    ("qwen3_next", "mlp_only_layers", [[1]], "mlp_only_layers"),
    ("qwen3_next", "mlp_only_layers", [7], "mlp_only_layers"),
    ("qwen3_next", "num_experts", 2, "num_experts"),
    ("qwen3_next", "decoder_sparse_step", 2, "decoder_sparse_step"),
    ("granite", "num_local_experts", 0, "num_local_experts"),
    ("granite", "mamba_n_heads", 8, "mamba_n_heads"),
    ("granite", "mamba_n_groups", 3, "mamba_n_groups"),
    ("granite", "time_step_limit", [1.0, 0.0], "time_step_limit"),
    ("lfm2", "conv_L_cache", 1, "conv_L_cache"),
    ("qwen3_next", "linear_num_key_heads", 3, "linear_num_key_heads"),
    ("qwen3_next", "partial_rotary_factor", 0.3, "partial_rotary_factor"),
    ("granite", "quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ("gemma3", "num_hidden_layers", 1_000_000, "num_hidden_layers"),
    ("granite", "num_hidden_layers", 5, "num_hidden_layers"),
]


@pytest.mark.parametrize(("family", "key", "value", "field"), REPORTED)
def test_reported_cases(
    family: str,
    key: str,
    value: Any,
    field: str | None,
    checkpoints: dict[str, Path],
    tmp_path: Path,
) -> None:
    src = checkpoints[family]
    message = outcome(_with(src, tmp_path / "m", mutated(_config(src), key, value)))
    if field is None:
        assert message is None, message
    else:
        assert message is not None, "loaded"
        check_refusal(message, field)


@pytest.mark.parametrize("family", FAMILIES)
def test_rope_subfields_and_types(
    family: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """Every field inside rope_parameters (Gemma 3: in each layer type's entry) mutated, and
    every rope type the engine does not compute, in both layouts."""
    src = checkpoints[family]
    config = _config(src)
    if family == "granite":
        config["position_embedding_type"] = "rope"
    nested = family == "gemma3"
    entries = list(config["rope_parameters"]) if nested else [None]
    n = 0
    for entry in entries:
        inner = config["rope_parameters"][entry] if nested else config["rope_parameters"]
        for key in [*inner, "factor"]:
            for value in [DROP, "x", 0, -2.0, math.nan, [1], "yarn", "linear"]:
                rope = mutated(inner, key, value)
                params = {**config["rope_parameters"], entry: rope} if nested else rope
                bad = _with(src, tmp_path / f"r{n}", {**config, "rope_parameters": params})
                check_refusal(outcome(bad), key, "rope_parameters")
                n += 1
    for rope_type in ("yarn", "dynamic", "longrope", "llama3"):
        v4 = {k: v for k, v in config.items() if k != "rope_parameters"}
        v4["rope_scaling"] = {"type": rope_type, "factor": 2.0}
        message = outcome(_with(src, tmp_path / f"t{n}", v4))
        assert message is not None and "rope_scaling.type" in message and rope_type in message
        n += 1


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_weights_that_are_not_finite_are_refused(
    poison: float, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    bad = _with(checkpoints["lfm2"], tmp_path / "m", _config(checkpoints["lfm2"]))
    weights = load_file(str(bad / "model.safetensors"))
    name = "model.layers.2.feed_forward.w2.weight"
    weights[name][3, 5] = poison
    save_file(weights, str(bad / "model.safetensors"))
    check_refusal(outcome(bad) or "loaded", name)


def test_weight_files_that_disagree_with_the_config_are_refused(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A tensor of an integer dtype, one too many, a header that lies about its data."""
    src = checkpoints["qwen3_next"]
    weights = load_file(str(src / "model.safetensors"))
    name = "model.layers.0.linear_attn.A_log"
    cases = {
        "int": ({**weights, name: weights[name].to(torch.int32)}, name),
        "extra": ({**weights, "model.layers.0.extra": torch.zeros(2)}, "model.layers.0.extra"),
    }
    for label, (tensors, field) in cases.items():
        bad = _with(src, tmp_path / label, _config(src))
        save_file(tensors, str(bad / "model.safetensors"))
        check_refusal(outcome(bad) or "loaded", field)
    bad = _with(src, tmp_path / "truncated", _config(src))
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    check_refusal(outcome(bad) or "loaded", "model.safetensors")


def test_sharded_weights_load_and_their_index_is_checked(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """The same tensors in two shards named by model.safetensors.index.json serve exactly as
    the single file does; an index naming a file outside the directory, or a tensor held by
    two shards, is refused."""
    src = checkpoints["granite"]
    weights = load_file(str(src / "model.safetensors"))
    names = sorted(weights)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}

    def sharded(label: str, index: dict[str, str], extra: list[str]) -> Path:
        d = _with(src, tmp_path / label, _config(src))
        (d / "model.safetensors").unlink()
        for file, held in shards.items():
            save_file({n: weights[n] for n in held + extra}, str(d / file))
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
        return d

    index = {n: file for file, held in shards.items() for n in held}
    good = sharded("good", index, [])
    want = LLM(model=str(src), enable_caching=False).generate([PROMPT], GREEDY)[0].token_ids
    assert (
        LLM(model=str(good), enable_caching=False).generate([PROMPT], GREEDY)[0].token_ids == want
    )
    outside = sharded("outside", {**index, names[0]: "../a.safetensors"}, [])
    check_refusal(outcome(outside) or "loaded", "weight_map")
    twice = sharded("twice", index, [names[-1]])  # the last tensor in both shards
    check_refusal(outcome(twice) or "loaded", names[-1])


# Run in a fresh process: its peak RSS after the imports is the baseline, so whatever the
# refused loads allocate shows as growth.
MEMORY_PROBE = """
import json, resource, sys
from kvreuse.engine import LLM
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
messages = []
for directory in sys.argv[1:]:
    try:
        LLM(model=directory, enable_caching=False)
        messages.append(None)
    except ValueError as exc:
        messages.append(str(exc))
growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print(json.dumps({"growth_mb": growth / 1024, "messages": messages}))
"""


def test_huge_declared_sizes_are_refused_before_allocating(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    """A million layers (listed in layer_types, or derived from an absent layer_types) and
    sizes of 10⁹ are refused while the weights' headers are compared, growing the process by
    far less than the gigabytes they would take."""
    million = 1_000_000
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("qwen3_next", {"num_hidden_layers": million,
                        "layer_types": ["linear_attention"] * million}, "num_hidden_layers"),
        ("granite", {"num_hidden_layers": million, "layer_types": None}, "num_hidden_layers"),
        ("granite", {"num_hidden_layers": 60_000, "layer_types": None}, "num_hidden_layers"),
        ("gemma3", {"hidden_size": 10**9}, "hidden_size"),
        ("lfm2", {"vocab_size": 10**9}, "vocab_size"),
        ("qwen3_next", {"num_experts": 10**9}, "num_experts"),
        ("granite", {"mamba_d_state": 10**9}, "mamba_d_state"),
    ]  # fmt: skip
    dirs = []
    for i, (family, change, _) in enumerate(cases):
        src = checkpoints[family]
        dirs.append(str(_with(src, tmp_path / str(i), {**_config(src), **change})))
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_PROBE, *dirs], capture_output=True, text=True, check=True
    )
    report = json.loads(proc.stdout.splitlines()[-1])
    for (_, _, field), message in zip(cases, report["messages"], strict=True):
        assert message is not None
        check_refusal(message, field)
    assert report["growth_mb"] < 200, report


def test_the_command_line_prints_one_line(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """`kvreuse geometry from-model DIR` and `kvreuse serve --model DIR` on a malformed
    checkpoint: exit status 2 and one line on stderr naming the field, no traceback."""
    src = checkpoints["gemma3"]
    bad = _with(src, tmp_path / "bad", {**_config(src), "layer_types": [["x"]] * 4})
    nan = _with(src, tmp_path / "nan", {**_config(src), "query_pre_attn_scalar": math.nan})
    commands = [
        (["geometry", "from-model", str(bad)], "layer_types"),
        (["serve", "--model", str(nan), "--host", "127.0.0.1", "--port", "0"],
         "query_pre_attn_scalar"),
    ]  # fmt: skip
    for args, field in commands:
        proc = subprocess.run(
            [sys.executable, "-m", "kvreuse", *args], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2, proc.stderr
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert field in lines[0]
