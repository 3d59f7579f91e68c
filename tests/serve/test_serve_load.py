"""Concurrency, overload, disconnects and reset under load, on a real uvicorn socket."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest
from openai import AsyncOpenAI

from kvreuse.serve import fake_backend
from kvreuse.serve.app import create_app
from kvreuse.serve.server import ServerThread
from serve_util import GatedEngine, scrape, wait_for

MODEL = "kvreuse-fake"


@pytest.fixture
def gated() -> Iterator[tuple[str, GatedEngine, object]]:
    backend = fake_backend()
    gate = GatedEngine(backend.scheduler.engine)
    backend.scheduler.engine = gate
    app = create_app(backend, max_pending=3)
    try:
        with ServerThread(app) as url:
            yield url, gate, app.state.engine
    finally:
        gate.resume()


def _inbox_has_work(engine: object) -> bool:
    return engine._inbox.qsize() > 0  # type: ignore[attr-defined]


def test_64_concurrent_streaming_clients_reconcile() -> None:
    backend = fake_backend()
    with ServerThread(create_app(backend, max_pending=256)) as url:
        before = scrape(url)
        results = asyncio.run(_load(url, clients=64, per_client=5))
        after = scrape(url)
    assert len(results) == 320
    assert all(u is not None for u, _ in results), "a stream lacked its usage block"
    cached = sum(u.prompt_tokens_details.cached_tokens for u, _ in results)
    prompts = sum(u.prompt_tokens for u, _ in results)
    d = {k: after[k] - before.get(k, 0) for k in after}
    assert d["kvreuse:prefix_cache_hits_total"] == cached > 0
    assert d["kvreuse:prefix_cache_queries_total"] == prompts
    assert d["kvreuse:prefix_cache_requests_total"] == 320
    assert after["kvreuse:num_requests_running"] == 0 == after["kvreuse:num_requests_waiting"]
    assert after["kvreuse:kv_cache_usage_perc"] == 0
    assert all(len(text) == 4 for _, text in results)
    backend.mgr.check_invariants()


async def _load(url: str, clients: int, per_client: int) -> list[tuple[object, str]]:
    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client:

        async def one(c: int, i: int) -> tuple[object, str]:
            # shared system prefixes (8 of them) plus a per-request suffix: many partial hits
            prompt = f"system prompt {c % 8} " * 12 + f"client {c} request {i} " * (1 + i)
            stream = await client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=4,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            usage, text = None, ""
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                text += "".join(ch.text for ch in chunk.choices)
            return usage, text

        async def worker(c: int) -> list[tuple[object, str]]:
            return [await one(c, i) for i in range(per_client)]

        groups = await asyncio.gather(*(worker(c) for c in range(clients)))
    return [r for g in groups for r in g]


def test_overload_is_429_never_a_hang(gated: tuple[str, GatedEngine, object]) -> None:
    url, gate, _ = gated
    gate.pause()
    body = {"model": MODEL, "prompt": "hold on " * 10, "max_tokens": 50, "stream": True}
    with httpx.Client(timeout=30) as http:
        streams = [http.stream("POST", url + "/v1/completions", json=body) for _ in range(3)]
        responses = [s.__enter__() for s in streams]  # headers arrive after submission
        assert all(r.status_code == 200 for r in responses)
        r = http.post(url + "/v1/completions", json={**body, "stream": False})
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_exceeded"
        gate.resume()
        for s, resp in zip(streams, responses, strict=True):
            assert resp.read().endswith(b"data: [DONE]\n\n")
            s.__exit__(None, None, None)
        assert http.post(url + "/v1/completions", json={**body, "stream": False}).is_success


def test_reset_is_409_while_blocks_are_in_use(gated: tuple[str, GatedEngine, object]) -> None:
    url, gate, engine = gated
    body = {"model": MODEL, "prompt": "busy " * 20, "max_tokens": 200, "stream": True}
    gate.pause()  # the request's first step will block: it stays running
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", url + "/v1/completions", json=body) as resp,
    ):
        lines = resp.iter_lines()
        assert gate.blocked.wait(10)
        answer: list[httpx.Response] = []
        t = threading.Thread(target=lambda: answer.append(http.post(url + "/reset_prefix_cache")))
        t.start()
        wait_for(lambda: _inbox_has_work(engine), "the reset to reach the step loop")
        gate.resume()
        t.join()
        assert answer[0].status_code == 409
        assert answer[0].json()["error"]["code"] == "cache_in_use"
        rest = list(lines)
    assert [x for x in rest if x][-1] == "data: [DONE]"
    assert httpx.post(url + "/reset_prefix_cache").status_code == 200


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_and_frees_blocks(
    gated: tuple[str, GatedEngine, object], stream: bool
) -> None:
    url, gate, engine = gated
    body = {"model": MODEL, "prompt": "going away " * 30, "max_tokens": 1500, "stream": stream}
    aborted = 'kvreuse:request_finished_total{finished_reason="abort"}'
    gate.pause()  # the request cannot finish while paused
    if stream:
        with (
            httpx.Client(timeout=30) as http,
            http.stream("POST", url + "/v1/completions", json=body) as resp,
        ):
            assert resp.status_code == 200 and gate.blocked.wait(10)
        # leaving the block closed the connection mid-stream
    else:
        with (
            httpx.Client(timeout=httpx.Timeout(30, read=0.5)) as http,
            pytest.raises(httpx.ReadTimeout),
        ):
            http.post(url + "/v1/completions", json=body)  # cannot finish while paused
    wait_for(lambda: _inbox_has_work(engine), "the abort to reach the step loop")
    gate.resume()
    wait_for(lambda: scrape(url).get(aborted, 0) == 1, "the abort")
    m = scrape(url)
    assert m["kvreuse:num_requests_running"] == 0 == m["kvreuse:num_requests_waiting"]
    assert m['kvreuse:kv_blocks_in_use{group_kind="full"}'] == 0
    assert m['kvreuse:kv_blocks_in_use{group_kind="recurrent"}'] == 0
    assert m.get('kvreuse:request_finished_total{finished_reason="length"}', 0) == 0
