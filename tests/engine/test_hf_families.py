"""Hugging Face families in the engine, checked against `transformers`' own forward.

For each family a tiny random-weight checkpoint is built with `transformers`' config and model
classes and saved with `save_pretrained` (tests/engine/hf_tiny.py); the engine loads it through
`LLM(model=DIR)` and runs its own layer code on the paged, DCP-sharded cache.

* logits with caching off equal `transformers`' forward (prompt positions through the dense
  context, every sampled position through the paged runner), on DCP 1, 2 and 4, with a prefill
  split into chunks so states and pages cross step boundaries;
* warm = cold token for token over identical, extended, divergent and batched consumers, with
  the hits the spec's rules give (§7–§9.4), and speculative decoding on Granite;
* a checkpoint that loses its conv window is seen: the warm consumers then differ.

Tolerance: |Δlogit| ≤ 1e-3 (float32; logits here reach ±47). benchmarks/hf_agreement.py measures
at most 4.6e-5, the size of `transformers`' own disagreement between its cached decode and its
full forward (2.6e-5 on the Qwen3-Next checkpoint).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face family tests need transformers: pip install -e '.[test]'",
)

from hf_tiny import build, hf_logits  # noqa: E402

from kvreuse.deployment import Deployment, load_geometry  # noqa: E402
from kvreuse.engine import LLM, SamplingParams  # noqa: E402
from kvreuse.engine.paged import PagedContext  # noqa: E402
from kvreuse.hfconfig import GeometryOptions, model_geometry, read_model_spec  # noqa: E402

FAMILIES = ["granite", "gemma3", "lfm2", "qwen3_next"]
TOL = 1e-3
P, D, MAX_TOKENS = 70, 42, 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any]]:
    root = tmp_path_factory.mktemp("hf")
    return {f: (root / f, build(f, root / f, seed=i)) for i, f in enumerate(FAMILIES)}


def geometry(directory: Path, dcp: int = 2, **kw: Any) -> Deployment:
    """The model's own geometry with small pages (block 4) and a 32-token step budget, so a
    70-token prompt spans many pages, every rank and three prefill chunks."""
    opts = GeometryOptions(
        dcp_size=dcp, block_size=4, capacity_tokens=4096, max_num_batched_tokens=32, **kw
    )
    return load_geometry(model_geometry(directory, opts), directory.name)


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(11)
    base = [rng.randrange(256) for _ in range(P)]

    def tail(n: int, avoid: int) -> list[int]:
        t = [rng.randrange(256) for _ in range(n)]
        t[0] = (avoid + 1 + t[0] % 255) % 256
        return t

    return {
        "producer": base,
        "identical": list(base),
        "extended": base + tail(20, -1),
        "divergent1": base[:D] + tail(30, base[D]),
        "divergent2": base[:D] + tail(25, base[D]),
    }


def _run(llm: LLM, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], torch.Tensor, int]]:
    llm.runner.record_logits = True
    out = {}
    for name, prompt in prompts.items():
        res = llm.generate([prompt], GREEDY)[0]
        rows = torch.stack(llm.runner.logits_log[res.request_id][: len(res.token_ids)])
        out[name] = (res.token_ids, rows, res.cached_tokens)
        llm.mgr.check_invariants()
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_transformers_on_dcp_1_2_4(
    family: str, checkpoints: dict[str, tuple[Path, Any]]
) -> None:
    directory, ref = checkpoints[family]
    prompt = _prompts()["producer"]
    for dcp in (1, 2, 4):
        llm = LLM(model=str(directory), geometry=geometry(directory, dcp), enable_caching=False)
        llm.runner.record_logits = True
        res = llm.generate([prompt], GREEDY)[0]
        full = prompt + res.token_ids[:-1]
        want = hf_logits(ref, full)
        got = torch.stack(llm.runner.logits_log[res.request_id])  # prompt end, then each decode
        assert got.shape[0] == MAX_TOKENS
        assert torch.allclose(got, want[len(prompt) - 1 :], atol=TOL, rtol=0), (family, dcp)
        assert res.token_ids == want[len(prompt) - 1 :].argmax(-1).tolist()
        if dcp == 1:  # every prompt position, through the engine's dense context
            assert torch.allclose(llm.model.dense_logits(full), want, atol=TOL, rtol=0)


def _expected_hits(llm: LLM) -> dict[str, int]:
    """§7–§9.4 for this scenario (P mod u ≠ 0, D mod u ≠ 0): a resend reuses the replay point
    ⌊P/u⌋·u; a divergent prompt reuses its junction ⌊D/u⌋·u, except the first divergent one of
    a hybrid model (no state saved there yet; it saves the junction for the next)."""
    geo = llm.mgr.config.geometry
    u = geo.hash_unit
    assert P % u and D % u
    hybrid = any(g.kind == "recurrent" for g in geo.groups)
    rho, junction = P // u * u, D // u * u
    return {
        "producer": 0,
        "identical": rho,
        "extended": rho,
        "divergent1": 0 if hybrid else junction,
        "divergent2": junction,
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_warm_equals_cold_token_for_token(
    family: str, checkpoints: dict[str, tuple[Path, Any]]
) -> None:
    directory, _ = checkpoints[family]
    geo, prompts = geometry(directory), _prompts()
    warm = LLM(model=str(directory), geometry=geo)
    cold = LLM(model=str(directory), geometry=geo, enable_caching=False)
    w, c = _run(warm, prompts), _run(cold, prompts)
    expected = _expected_hits(warm)
    for name in prompts:
        assert w[name][0] == c[name][0], (family, name)
        assert torch.allclose(w[name][1], c[name][1], atol=TOL, rtol=0), (family, name)
        assert w[name][2] == expected[name], (family, name, w[name][2])
        assert c[name][2] == 0
    # batched: every consumer in one generate call, after the producer finished
    batch = [prompts[n] for n in ("identical", "extended", "divergent1", "divergent2")]
    warm_b = LLM(model=str(directory), geometry=geo)
    warm_b.generate([prompts["producer"]], GREEDY)
    got = warm_b.generate(batch, GREEDY)
    warm_b.mgr.check_invariants()
    assert [o.token_ids for o in got] == [
        c[n][0] for n in ("identical", "extended", "divergent1", "divergent2")
    ]
    assert got[0].cached_tokens == expected["identical"] > 0


def test_speculative_decoding_on_granite(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """n-gram drafts verified on the Mamba-2 hybrid: states after rejected drafts never reach
    the cache, so warm = cold = no speculation, token for token."""
    directory, _ = checkpoints["granite"]
    geo = geometry(directory)
    rng = random.Random(5)
    motif = [rng.randrange(256) for _ in range(9)]
    prompt = (motif * 8)[:P]  # repetition gives the n-gram proposer something to find
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    plain = LLM(model=str(directory), geometry=geo, enable_caching=False).generate([prompt], sp)
    for caching in (False, True):
        llm = LLM(
            model=str(directory),
            geometry=geo,
            enable_caching=caching,
            spec="ngram",
            num_spec_tokens=3,
        )
        runs = [llm.generate([prompt], sp)[0] for _ in range(2)]
        assert all(r.token_ids == plain[0].token_ids for r in runs), caching
        assert llm.runner.num_drafted > 0
        if caching:
            assert runs[1].cached_tokens > 0
        llm.mgr.check_invariants()


def test_a_lost_conv_window_is_seen(
    checkpoints: dict[str, tuple[Path, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint that keeps the SSM state but not the conv window (the k−1 inputs before the
    saved position): the warm consumers resume from it and no longer match the cold run."""
    directory, _ = checkpoints["granite"]
    geo, prompts = geometry(directory), _prompts()
    cold = _run(LLM(model=str(directory), geometry=geo, enable_caching=False), prompts)
    spec = read_model_spec(directory)
    finish = PagedContext.finish

    def drop_conv_window(self: PagedContext, t_new: int) -> list[int]:
        saved = finish(self, t_new)
        for save in self.plan.saves:
            for layer in self.cache.members[save.group_id] if save.position in saved else []:
                (name, (k, dim)), _ssm = spec.states[int(layer.rsplit(".", 1)[1])]
                assert name == "conv"  # the window comes first in the state row
                self.cache.state[layer][save.block, : k * dim] = 0.0
        return saved

    monkeypatch.setattr(PagedContext, "finish", drop_conv_window)
    warm = _run(LLM(model=str(directory), geometry=geo), prompts)
    assert warm["identical"][2] > 0  # it did resume from a saved state
    worst = max((warm[n][1] - cold[n][1]).abs().max().item() for n in ("identical", "extended"))
    assert worst > 100 * TOL, worst


def test_default_geometry_and_tokenizer_come_from_the_checkpoint(
    checkpoints: dict[str, tuple[Path, Any]],
) -> None:
    directory, _ = checkpoints["lfm2"]
    llm = LLM(model=str(directory))
    kinds = [g.kind for g in llm.mgr.config.geometry.groups]
    assert kinds == ["full", "recurrent"] and llm.model_name == "lfm2"
    out = llm.generate(["hello, hybrid world"], SamplingParams(temperature=0.0, max_tokens=3))
    assert out[0].prompt_token_ids == list(b"hello, hybrid world")  # the byte-level tokenizer.json


def test_bad_checkpoints_say_what_is_wrong(
    checkpoints: dict[str, tuple[Path, Any]], tmp_path: Path
) -> None:
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, _ = checkpoints["gemma3"]
    bad = tmp_path / "bad"
    shutil.copytree(src, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "layer_types": ["mamba"] * 4}))
    with pytest.raises(ValueError, match="unknown layer_types"):
        LLM(model=str(bad))
    (bad / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(bad / "model.safetensors"))
    name = "model.layers.0.self_attn.q_norm.weight"
    save_file({**weights, name: torch.zeros(3)}, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"q_norm\.weight has shape \(3,\)"):
        LLM(model=str(bad))
    del weights[name]
    save_file(weights, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor.*q_norm"):
        LLM(model=str(bad))


def test_a_lost_sliding_window_page_is_seen(checkpoints: dict[str, tuple[Path, Any]]) -> None:
    """A cache that kept one page too few of Gemma 3's sliding window: after the producer, the
    page just below the window a resend reads (W = 24 before the hit) is wiped, and the resend
    still matches the cold run; then the oldest page inside the window is wiped, and it no
    longer does."""
    directory, _ = checkpoints["gemma3"]
    geo, prompts = geometry(directory), _prompts()
    cold = _run(LLM(model=str(directory), geometry=geo, enable_caching=False), prompts)
    cold_rows = cold["identical"][1]
    warm = LLM(model=str(directory), geometry=geo)
    _run(warm, {"producer": prompts["producer"]})
    hit = _expected_hits(warm)["identical"]
    group = next(g for g in warm.mgr.config.geometry.groups if g.kind == "sliding")
    oldest = group.attend_from(hit) // group.page_size  # the first page the resend reads
    blocks = {e[1]: e[4] for e in warm.mgr.export_entries() if e[0] == group.group_id}

    def wipe(page: int) -> tuple[list[int], torch.Tensor, int]:
        for layer in warm.runner.cache.members[group.group_id]:
            for t in warm.runner.cache.kv[layer]:
                t[:, blocks[(page + 1) * group.page_size]] = 0.0
        return _run(warm, {"identical": prompts["identical"]})["identical"]

    below = wipe(oldest - 1)
    assert below[2] == hit > 0 and torch.allclose(below[1], cold_rows, atol=TOL, rtol=0)
    inside = wipe(oldest)
    assert inside[2] == hit
    assert (inside[1] - cold_rows).abs().max().item() > 100 * TOL
