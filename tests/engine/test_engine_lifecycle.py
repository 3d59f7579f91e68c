"""Engine under preemption and abort: outputs unchanged, invariants kept."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvreuse.core import Request
from kvreuse.deployment import preset
from kvreuse.engine import LLM, SamplingParams


def _prompts(n: int, length: int, seed: int = 1, shared: int | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(length // 2 if shared is None else shared)]
    return [shared + [rng.randrange(256) for _ in range(length - len(shared))] for _ in range(n)]


def _reference(geometry: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    llm = LLM(geometry=geometry, enable_caching=False)
    return [
        llm.generate([p], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].token_ids
        for p in prompts
    ]


def _drive(
    llm: LLM, prompts: list[list[int]], max_tokens: int, on_step=None
) -> dict[str, list[int]]:
    sched = llm.scheduler
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    rids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        sched.add(Request(rid, p), max_tokens, sampling=sp)
    while sched.has_work():
        sched.step()
        llm.mgr.check_invariants()
        if on_step is not None:
            on_step(sched)
    return {rid: sched.seqs[rid].output[:max_tokens] for rid in rids}


@pytest.mark.parametrize(
    ("geometry", "num_blocks", "length"),
    [("tiny-attention", 14, 60), ("tiny-hybrid-dcp4", 10, 110)],
)
def test_preemption_leaves_outputs_unchanged(geometry: str, num_blocks: int, length: int) -> None:
    """Four requests that outgrow a small pool: decode growth preempts (recompute) the newest."""
    prompts = _prompts(4, length, shared=8)
    ref = _reference(geometry, prompts, 30)
    llm = LLM(geometry=geometry, num_blocks=num_blocks)
    out = _drive(llm, prompts, 30)
    assert list(out.values()) == ref
    assert sum(s.preemptions for s in llm.scheduler.seqs.values()) > 0


def test_abort_mid_prefill_and_mid_decode() -> None:
    dep = preset("tiny-hybrid-dcp4")
    dep = dataclasses.replace(dep, sched=dataclasses.replace(dep.sched, max_num_batched_tokens=40))
    prompts = _prompts(3, 120, seed=2)
    ref = _reference("tiny-hybrid-dcp4", prompts, 10)
    llm = LLM(geometry=dep)
    aborted: dict[str, str] = {}

    def on_step(sched) -> None:
        s0, s1 = sched.seqs["r0"], sched.seqs["r1"]
        if "r0" not in aborted and not s0.finished and 0 < s0.scheduled < s0.prompt_len:
            sched.abort("r0")
            aborted["r0"] = "prefill"
        if "r1" not in aborted and not s1.finished and len(s1.output) >= 3:
            sched.abort("r1")
            aborted["r1"] = "decode"

    out = _drive(llm, prompts, 10, on_step)
    assert aborted == {"r0": "prefill", "r1": "decode"}
    assert out["r2"] == ref[2]
    assert out["r1"] == ref[1][: len(out["r1"])]
    # what the aborted requests published is sound: resending them reuses it and still matches
    again = llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=10))
    assert [o.token_ids for o in again] == ref[:2]
    assert again[1].cached_tokens > 0
    llm.mgr.check_invariants()


def test_stop_tokens_finish_early() -> None:
    llm = LLM(geometry="tiny-attention")
    prompt = _prompts(1, 60)[0]
    full = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 8
    stop = full.token_ids[3]
    first = full.token_ids.index(stop)
    res = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(stop,))
    )[0]
    assert res.finish_reason == "stop"
    assert res.token_ids == full.token_ids[: first + 1]
    assert not llm.scheduler.has_work()
    llm.mgr.check_invariants()


def test_generate_many_at_once_matches_one_by_one() -> None:
    prompts = _prompts(5, 80, seed=3)
    ref = _reference("tiny-sliding-hybrid", prompts, 6)
    outs = LLM(geometry="tiny-sliding-hybrid").generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=6)
    )
    assert [o.token_ids for o in outs] == ref


def test_text_prompts_and_sampling_params_validation() -> None:
    llm = LLM(geometry="tiny-attention")
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert out.prompt_token_ids == list(b"hello world")
    assert isinstance(out.text, str) and len(out.token_ids) == 3
    for bad in (
        {"max_tokens": 0},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"top_k": -1},
        {"seed": "x"},
        {"stop_token_ids": (-1,)},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 10], SamplingParams(temperature=0.0, max_tokens=llm.max_model_len))
    with pytest.raises(ValueError, match="spec"):
        LLM(geometry="tiny-attention", spec="medusa")
    with pytest.raises(ValueError, match="draft"):
        LLM(geometry="tiny-attention", spec="eagle")
