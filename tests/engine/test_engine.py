"""Engine equivalence: warm runs over the paged, DCP-sharded, hybrid cache give the same tokens
and logits as cold runs and as a dense cache-free forward, and reuse exactly what the spec's
rules say they must.

Scenario per geometry: a producer prompt of P = 150 tokens runs, then warm consumers: an
identical resend, an extension of the prompt, and two prompts that diverge after D = 90 tokens.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from kvreuse.engine import LLM, SamplingParams

P, D, MAX_TOKENS = 150, 90, 6
TOL = 1e-4


def _prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    base = [rng.randrange(256) for _ in range(P)]

    def tail(n: int, avoid: int) -> list[int]:
        t = [rng.randrange(256) for _ in range(n)]
        t[0] = (avoid + 1 + t[0] % 255) % 256  # differs from the token it must diverge from
        return t

    return {
        "producer": base,
        "identical": list(base),
        "extended": base + tail(40, -1),
        "divergent1": base[:D] + tail(60, base[D]),
        "divergent2": base[:D] + tail(50, base[D]),
    }


def _run(llm: LLM, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], Tensor, int]]:
    llm.runner.record_logits = True
    out = {}
    for name, prompt in prompts.items():
        res = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
        n = len(res.token_ids)
        logits = torch.stack(llm.runner.logits_log[res.request_id][:n])
        out[name] = (res.token_ids, logits, res.cached_tokens)
        llm.mgr.check_invariants()
    return out


Tensor = torch.Tensor


def _expected_hits(llm: LLM) -> dict[str, int]:
    """The spec's numbers (§7, §8, §9.4) for this scenario, with P mod u != 0 and D mod u != 0."""
    geo = llm.mgr.config.geometry
    u, drop = geo.hash_unit, geo.spec_mode == "drop"
    assert P % u and D % u
    rho = (P // u) * u - (u if drop else 0)  # §8 replay grid (none / lookahead L=1 / drop)
    junction = (D // u) * u - (u if drop else 0)  # last shared boundary; drop: one unit less
    hybrid = any(g.kind == "recurrent" for g in geo.groups)
    return {
        "producer": 0,
        "identical": rho,
        "extended": rho,  # shares exactly the prompt; a state exists at rho (replay point)
        "divergent1": 0 if hybrid else junction,  # no state below the producer's checkpoints
        "divergent2": junction,  # hybrid: divergent1 saved the junction state
    }


def _check_scenario(geometry: str, spec: str | None = None) -> LLM:
    prompts = _prompts()
    warm = LLM(geometry=geometry, spec=spec)
    cold = LLM(geometry=geometry, spec=spec, enable_caching=False)
    w, c = _run(warm, prompts), _run(cold, prompts)
    assert warm.mgr.replay_point(P) == _expected_hits(warm)["identical"]
    for name, prompt in prompts.items():
        toks, logits, hit = w[name]
        assert toks == c[name][0], name
        assert torch.allclose(logits, c[name][1], atol=TOL, rtol=0), name
        dense = warm.model.dense_logits(prompt + toks[:-1])[len(prompt) - 1 :]
        assert torch.allclose(logits, dense, atol=TOL, rtol=0), name
        assert hit == _expected_hits(warm)[name], (name, hit)
        assert c[name][2] == 0
    return warm


@pytest.mark.parametrize(
    "geometry",
    ["tiny-attention", "tiny-attention-dcp4", "tiny-hybrid-dcp4", "tiny-sliding-hybrid"],
)
def test_warm_equals_cold_and_dense(geometry: str) -> None:
    _check_scenario(geometry)


@pytest.mark.parametrize(
    ("geometry", "spec"),
    [
        ("tiny-spec-lookahead", "ngram"),
        ("tiny-spec-lookahead", "eagle"),
        ("tiny-spec-drop", "ngram"),
        ("tiny-spec-drop", "eagle"),
    ],
)
def test_spec_decode_modes(geometry: str, spec: str) -> None:
    warm = _check_scenario(geometry, spec)
    assert warm.runner.num_drafted > 0


@pytest.mark.parametrize("geometry", ["tiny-spec-lookahead", "tiny-spec-drop"])
def test_eagle_drafter_kv_reused_exactly(geometry: str) -> None:
    """In lookahead and drop modes a hit proves the token after it (§8), so the draft head's
    reused KV equals a cold run's: the warm consumers propose exactly the cold drafts."""
    prompts = _prompts()
    runs = []
    for caching in (True, False):
        llm = LLM(geometry=geometry, spec="eagle", enable_caching=caching)
        llm.runner.record_logits = True
        rids = [
            llm.generate([p], SamplingParams(temperature=0.0, max_tokens=8))[0].request_id
            for p in prompts.values()
        ]
        runs.append([llm.runner.drafts_log.get(r) for r in rids])
    assert runs[0] == runs[1]
    assert all(runs[0])


def test_seeded_sampling_is_unchanged_by_cache_and_speculation() -> None:
    prompts = _prompts()
    sp = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=50, seed=3)
    ref = [
        o.token_ids
        for o in LLM(geometry="tiny-spec-drop", enable_caching=False).generate(
            list(prompts.values()), sp
        )
    ]
    for spec in ("ngram", "eagle"):
        llm = LLM(geometry="tiny-spec-drop", spec=spec)
        got = [llm.generate([p], sp)[0].token_ids for p in prompts.values()]
        assert got == ref, spec


def test_importing_kvreuse_does_not_import_torch() -> None:
    """The engine names are listed (in __all__ and dir()) but loaded on first use."""
    code = (
        "import sys, kvreuse; assert 'torch' not in sys.modules; "
        "assert {'LLM', 'SamplingParams'} <= set(kvreuse.__all__) & set(dir(kvreuse)); "
        "assert 'torch' not in sys.modules; "
        "kvreuse.LLM; kvreuse.SamplingParams; assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_star_import_loads_the_engine_names() -> None:
    """`from kvreuse import *` follows __all__, so it loads LLM and SamplingParams (and torch)."""
    code = "from kvreuse import *; import sys; LLM, SamplingParams; assert 'torch' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
