"""`ScriptedEngine`: one step loop, the token source and the save policy as parameters."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kvreuse import Request
from kvreuse.sched import (
    POSITIONAL_PERIOD,
    ContentTokens,
    FakeEngine,
    PositionalTokens,
    ReplayTokens,
    ScriptedEngine,
    Seq,
    token_at,
)


def _seq(rid: str, prompt: list[int], output: Sequence[int] = ()) -> Seq:
    seq = Seq(Request(rid, prompt), 64, len(prompt), len(prompt) + len(output))
    seq.output = list(output)
    return seq


def _step(rid: str, start: int, num_new: int, saves: Sequence[int] = ()) -> Any:
    """The fields of a StepPlan the engine reads."""
    plan = SimpleNamespace(
        request_id=rid,
        start=start,
        num_new_tokens=num_new,
        saves=[SimpleNamespace(position=p) for p in saves],
    )
    return SimpleNamespace(requests=[plan])


def _old_content_token(tokens: list[int]) -> int:
    """The fake server backend's token before the engines were merged."""
    tail = ",".join(map(str, tokens[-64:]))
    digest = hashlib.blake2b(f"{len(tokens)}/{tail}".encode(), digest_size=4).digest()
    return 97 + int.from_bytes(digest, "big") % 26


@pytest.mark.parametrize(
    ("prompt_len", "output_len"), [(1, 0), (10, 3), (63, 1), (100, 0), (5, 90)]
)
def test_content_tokens_are_the_fake_backends_tokens(prompt_len: int, output_len: int) -> None:
    rng = random.Random(prompt_len * 1000 + output_len)
    prompt = [rng.randrange(256) for _ in range(prompt_len)]
    output = [rng.randrange(256) for _ in range(output_len)]
    seq = _seq("r", prompt, output)
    got = ContentTokens()(seq, seq.num_tokens, ())
    assert got == _old_content_token(prompt + output)
    assert 97 <= got <= 122


def test_positional_tokens_are_token_at() -> None:
    seq = _seq("r7", [1, 2, 3])
    source = PositionalTokens(500)
    assert source(seq, 3, ()) == token_at("r7", 3, 500)
    period = POSITIONAL_PERIOD
    for rid, start, stop in [
        ("r7", 0, 40),
        ("a", period - 3, period + 5),
        ("b", 9, 9 + 2 * period + 7),
    ]:
        run = source.run(rid, start, stop)
        assert run == [token_at(rid, p, 500) for p in range(start, stop)], (rid, start, stop)
        assert all(0 <= t < 500 for t in run)
    assert source.run("r7", 5, 5) == []
    # different requests read different tokens; a request's tokens repeat only after a period
    assert source.run("r7", 0, 40) != source.run("r8", 0, 40)
    assert (
        token_at("r7", 11) == token_at("r7", 11 + period)
        and len(set(PositionalTokens().run("r7", 0, 400))) > 390  # vocab 32,000: few repeats
    )


def test_save_policies_report_the_end_or_everything_up_to_it() -> None:
    seq = _seq("r", list(range(40)))
    at_end = ScriptedEngine(PositionalTokens(), saves="at_end")
    up_to = ScriptedEngine(PositionalTokens(), saves="up_to_end")
    step = _step("r", 0, 32, saves=[16, 32])  # a prefill chunk ending at 32
    assert at_end(step, {"r": seq})[0] == (32, [], [32])
    assert up_to(step, {"r": seq})[0] == (32, [], [16, 32])
    assert at_end.num_forward_tokens == up_to.num_forward_tokens == 32


def test_drafts_are_all_rejected_at_rate_zero() -> None:
    seq = _seq("r", list(range(10)))
    engine = ScriptedEngine(PositionalTokens(), accept_rate=0.0)
    t_new, new, _ = engine(_step("r", 9, 4), {"r": seq})[0]  # one token + 3 drafts
    assert (t_new, new) == (10, [token_at("r", 10)])


def test_fake_engine_accepts_a_seeded_prefix_of_the_drafts() -> None:
    seq = _seq("r", list(range(10)))
    step = _step("r", 9, 4)  # one token + 3 drafts
    t_new, new, _ = FakeEngine(accept_rate=1.0)(step, {"r": seq})[0]
    assert t_new == 13 and new == [token_at("r", p) for p in range(10, 14)]
    runs = [FakeEngine(accept_rate=0.5, seed=s)(step, {"r": seq})[0] for s in range(20)]
    assert runs == [FakeEngine(accept_rate=0.5, seed=s)(step, {"r": seq})[0] for s in range(20)]
    assert len({t for t, _, _ in runs}) > 1  # the seed decides how many are accepted


def test_replay_tokens_replay_the_recorded_output() -> None:
    script = ReplayTokens()
    script.outputs["r"] = [7, 8, 9]
    engine = ScriptedEngine(script, saves="up_to_end")
    seq = _seq("r", [1, 2, 3], [7])
    assert engine(_step("r", 3, 1), {"r": seq})[0] == (4, [8], [])


def test_content_tokens_after_accepted_drafts_see_the_drafts() -> None:
    seq = _seq("r", [1, 2, 3])
    engine = ScriptedEngine(ContentTokens(), accept_rate=1.0)
    ((t_new, new, _),) = engine(_step("r", 2, 3), {"r": seq})
    assert t_new == 5
    assert new[1] == _old_content_token([1, 2, 3, new[0]])


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [({"accept_rate": 1.5}, "accept_rate"), ({"saves": "never"}, "saves must be one of")],
)
def test_bad_parameters_are_named(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        ScriptedEngine(PositionalTokens(), **kwargs)
