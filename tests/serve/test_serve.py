"""The OpenAI-compatible server on a real uvicorn socket, driven by the official client."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from kvreuse.serve import fake_backend
from kvreuse.serve.app import create_app
from kvreuse.serve.server import ServerThread
from serve_util import scrape

U = 16  # the fake geometry's hash unit
MODEL = "kvreuse-fake"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with ServerThread(create_app(fake_backend())) as base:
        yield base


@pytest.fixture
def client(url: str) -> Iterator[OpenAI]:
    with OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def _prompt(tag: str, n: int) -> str:
    return (tag * n)[:n]


def test_health_and_models(url: str, client: OpenAI) -> None:
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_cold_then_warm(client: OpenAI) -> None:
    p = _prompt("cold-warm ", 300)
    cold = client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
    warm = client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens == (300 - 1) // U * U
    assert warm.choices[0].text == cold.choices[0].text and len(cold.choices[0].text) == 6
    assert cold.usage.completion_tokens == 6 and cold.choices[0].finish_reason == "length"


def test_completion_token_ids_prompt(client: OpenAI) -> None:
    ids = [7, 8, 9] * 40
    r = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=2, extra_body={"return_token_ids": True}
    )
    choice = r.model_dump()["choices"][0]
    assert choice["prompt_token_ids"] == ids and len(choice["token_ids"]) == 2
    assert r.usage.prompt_tokens == 120


def test_streaming_completion_usage(client: OpenAI) -> None:
    p = _prompt("stream ", 200)
    for expect in (0, (200 - 1) // U * U):
        chunks = list(
            client.completions.create(
                model=MODEL,
                prompt=p,
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        usage = [c.usage for c in chunks if c.usage is not None]
        assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == expect
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert len(text) == 5
        assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_turns_reuse_previous_turn(client: OpenAI) -> None:
    msgs = [
        {"role": "system", "content": "You are terse. " * 10},
        {"role": "user", "content": "Tell me about prefix caching. " * 5},
    ]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    answer = first.choices[0].message.content
    assert first.choices[0].message.role == "assistant" and len(answer) == 8
    msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More."}]
    second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)
    # the template is prefix-stable: the whole first prompt + answer is a prefix of the second
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert reused >= (first.usage.prompt_tokens // U) * U


def test_chat_streaming_usage(client: OpenAI) -> None:
    msgs = [{"role": "user", "content": "stream me " * 20}]
    seen = []
    for _ in range(2):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[0].choices[0].delta.role == "assistant"
        usage = chunks[-1].usage
        assert usage is not None and chunks[-1].choices == []
        seen.append(usage.prompt_tokens_details.cached_tokens)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert seen[0] == 0 and seen[1] == (usage.prompt_tokens - 1) // U * U


@pytest.mark.parametrize("stream", [False, True])
def test_cache_salt_isolates_tenants(client: OpenAI, stream: bool) -> None:
    p = _prompt(f"salted-{stream} ", 260)
    warm = (260 - 1) // U * U

    def cached(salt: str | None) -> int:
        body = {"cache_salt": salt} if salt is not None else {}
        if not stream:
            r = client.completions.create(model=MODEL, prompt=p, max_tokens=2, extra_body=body)
            return r.usage.prompt_tokens_details.cached_tokens
        chunks = client.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=2,
            stream=True,
            extra_body=body,
            stream_options={"include_usage": True},
        )
        return next(c.usage for c in chunks if c.usage).prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") == warm  # same salt reuses
    assert cached("tenant-b") == 0  # a different salt does not
    assert cached(None) == 0  # nor does no salt
    assert cached("tenant-b") == warm and cached(None) == warm


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x" * 2048}, "prompt"),
        ({"prompt": "x" * 2040, "max_tokens": 16}, "max_tokens"),
        ({"prompt": "hi", "model": "gpt-4"}, "model"),
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": [1, 999]}, "prompt"),
        ({"prompt": "hi", "cache_salt": 7}, "cache_salt"),
        ({"prompt": "hi", "n": 2}, "n"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
def test_bad_completion_requests_are_400(url: str, body: dict[str, object], param: str) -> None:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_bad_chat_and_json_are_400(url: str, client: OpenAI) -> None:
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
    )
    assert r.status_code == 400
    r = httpx.post(
        url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 400 and info.value.code == "model_not_found"


def test_metrics_names_and_reconciliation(url: str, client: OpenAI) -> None:
    before = scrape(url)
    total = 0
    for i in range(3):
        r = client.completions.create(model=MODEL, prompt=_prompt("recon ", 100 + i), max_tokens=1)
        total += r.usage.prompt_tokens_details.cached_tokens
    after = scrape(url)
    assert total > 0
    hits = "kvreuse:prefix_cache_hits_total"
    assert after[hits] - before[hits] == total
    assert (
        after["kvreuse:prefix_cache_queries_total"] - before["kvreuse:prefix_cache_queries_total"]
        == 100 + 101 + 102
    )
    for name in (
        "kvreuse:kv_cache_usage_perc",
        "kvreuse:num_requests_running",
        "kvreuse:num_requests_waiting",
        "kvreuse:num_preemptions_total",
        "kvreuse:kv_blocks_evicted_total",
        'kvreuse:prefix_cache_reason_total{reason="no_entry"}',
    ):
        assert name in after, name
    assert after["kvreuse:num_requests_running"] == 0 == after["kvreuse:kv_cache_usage_perc"]


def test_reset_prefix_cache_when_idle(url: str, client: OpenAI) -> None:
    p = _prompt("reset ", 100)
    client.completions.create(model=MODEL, prompt=p, max_tokens=1)
    assert httpx.post(url + "/reset_prefix_cache").status_code == 200
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=1)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_streams_carry_usage_only_when_asked_unless_forced() -> None:
    """OpenAI semantics by default; `force_include_usage` (vLLM's flag) adds it to every stream."""
    for force in (False, True):
        with (
            ServerThread(create_app(fake_backend(), force_include_usage=force)) as base,
            OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as c,
        ):
            p = _prompt("force ", 100)
            cached = []
            for _ in range(2):  # cold, then warm
                stream = c.completions.create(model=MODEL, prompt=p, max_tokens=3, stream=True)
                chunks = list(stream)
                usage = [x.usage for x in chunks if x.usage is not None]
                assert len(usage) == (1 if force else 0)
                cached += [u.prompt_tokens_details.cached_tokens for u in usage]
            assert cached == ([0, (100 - 1) // U * U] if force else [])


def test_a_stop_token_ends_the_answer_and_is_left_out() -> None:
    """The scheduler stops at the first stop token; the server leaves that token out."""
    prompt = _prompt("halt ", 40)
    with (
        ServerThread(create_app(fake_backend())) as base,
        OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as c,
    ):
        free = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, extra_body={"return_token_ids": True}
        )
    ids = free.choices[0].token_ids
    i = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])  # its first occurrence
    backend = fake_backend()
    backend.tokenizer.eos_token_id = ids[i]
    for stream in (False, True):
        with (
            ServerThread(create_app(backend)) as base,
            OpenAI(base_url=base + "/v1", api_key="none", max_retries=0) as c,
        ):
            if stream:
                chunks = list(
                    c.completions.create(
                        model=MODEL,
                        prompt=prompt,
                        max_tokens=12,
                        stream=True,
                        stream_options={"include_usage": True},
                    )
                )
                text = "".join(x.choices[0].text for x in chunks if x.choices)
                reason = next(
                    x.choices[0].finish_reason
                    for x in chunks
                    if x.choices and x.choices[0].finish_reason
                )
                used = next(x.usage for x in chunks if x.usage).completion_tokens
            else:
                r = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12)
                text, reason = r.choices[0].text, r.choices[0].finish_reason
                used = r.usage.completion_tokens
        assert reason == "stop" and text == free.choices[0].text[:i]
        assert used == i  # the stop token is not part of the answer
