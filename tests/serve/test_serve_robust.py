"""One request never takes the server down, and bad input is a 400 naming the problem (never a
plain-text 500 or a 503), on a real uvicorn socket."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvreuse.core import KVCacheManager
from kvreuse.sched import Scheduler
from kvreuse.serve import fake_backend
from kvreuse.serve.app import create_app
from kvreuse.serve.protocol import SEED_MAX, SEED_MIN
from kvreuse.serve.server import ServerThread
from serve_util import GatedEngine, PoisonEngine, scrape, wait_for

MODEL = "kvreuse-fake"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    backend = fake_backend()
    backend.scheduler.engine = PoisonEngine(backend.scheduler.engine)
    with ServerThread(create_app(backend)) as base:
        yield base


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"]
    return err


def _healthy(url: str) -> None:
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    r = httpx.post(url + "/v1/completions", json={"prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"][0]["text"]) == 2


def _post(url: str, path: str, raw: str) -> httpx.Response:
    headers = {"content-type": "application/json"}
    return httpx.post(url + path, content=raw.encode(), headers=headers, timeout=30)


# ---------------------------------------------------------------------- item 1: the step loop
@pytest.mark.parametrize("seed", [SEED_MAX + 1, SEED_MIN - 1, 10**30])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_seed_outside_the_generator_range_is_a_400(url: str, seed: int, path: str) -> None:
    body: dict[str, Any] = {"max_tokens": 2, "seed": seed}
    if path == "/v1/completions":
        body["prompt"] = "hello"
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]
    err = _error(httpx.post(url + path, json=body), 400)
    assert err["param"] == "seed" and str(SEED_MAX) in err["message"]
    assert str(SEED_MIN) in err["message"]
    _healthy(url)


@pytest.mark.parametrize("seed", [SEED_MAX, SEED_MIN, 0])
def test_a_seed_inside_the_range_is_accepted(url: str, seed: int) -> None:
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "seed": seed})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_lone_surrogate_salt_is_a_400_and_the_loop_lives(url: str, path: str) -> None:
    body = (
        '"prompt": [1, 2, 3]'
        if path == "/v1/completions"
        else ('"messages": [{"role": "user", "content": "hi"}]')
    )
    raw = "{" + body + ', "max_tokens": 8, "cache_salt": "\\ud800"}'
    err = _error(_post(url, path, raw), 400)
    assert err["param"] == "cache_salt" and "surrogate" in err["message"]
    _healthy(url)


def test_a_failing_step_fails_only_its_request(url: str) -> None:
    before = scrape(url)
    r = httpx.post(url + "/v1/completions", json={"prompt": "POISON pill", "max_tokens": 3})
    err = _error(r, 500)
    assert err["type"] == "server_error" and err["code"] == "step_failed"
    assert "cannot run this request" in err["message"]
    chunks = httpx.post(
        url + "/v1/completions", json={"prompt": "POISON again", "max_tokens": 3, "stream": True}
    ).text.split("\n\n")
    assert json.loads(chunks[0].removeprefix("data: "))["error"]["code"] == "step_failed"
    assert chunks[1] == "data: [DONE]"
    _healthy(url)
    after = scrape(url)
    assert after["kvreuse:num_requests_running"] == 0 == after["kvreuse:kv_cache_usage_perc"]
    key = 'kvreuse:request_finished_total{finished_reason="error"}'
    assert after[key] - before.get(key, 0) == 2


def _broken_backend() -> tuple[Any, GatedEngine]:
    """A backend whose step recovery itself fails: the core refuses to discard."""

    class NoDiscard(KVCacheManager):
        def discard(self, step_id: int) -> None:
            raise RuntimeError("discard is broken")

    backend = fake_backend()
    old = backend.scheduler
    gate = GatedEngine(PoisonEngine(old.engine))
    backend.scheduler = Scheduler(NoDiscard(old.mgr.config), gate, old.config)
    return backend, gate


def test_a_broken_loop_fails_everything_at_once_and_exits_non_zero() -> None:
    backend, gate = _broken_backend()
    app = create_app(backend)
    server = ServerThread(app)
    url = server.start()
    try:
        gate.pause()
        answers: dict[str, httpx.Response] = {}

        def get(name: str, method: str, path: str, **kw: Any) -> threading.Thread:
            def go() -> None:
                answers[name] = httpx.request(method, url + path, timeout=20, **kw)

            t = threading.Thread(target=go)
            t.start()
            return t

        body = {"prompt": "POISON pill", "max_tokens": 3}
        threads = [get("poison", "POST", "/v1/completions", json=body)]
        assert gate.blocked.wait(10)
        threads.append(get("metrics", "GET", "/metrics"))  # queued behind the blocked step
        wait_for(lambda: app.state.engine._inbox.qsize() > 0, "the scrape to be queued")
        gate.resume()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a call queued at the crash hung"
        assert _error(answers["metrics"], 503)["type"] == "service_unavailable"
        assert _error(answers["poison"], 503)["message"].startswith("the step loop failed")
        server.thread.join(30)  # the server stops by itself
        assert not server.thread.is_alive() and server.server.exit_code == 1
    finally:
        gate.resume()
        server.stop()


def test_health_metrics_and_reset_are_503_json_once_the_loop_is_gone() -> None:
    backend, _ = _broken_backend()
    app = create_app(backend)
    server = ServerThread(app)
    app.state.engine.on_fatal = None  # keep serving after the failure, to ask it
    with server as url:
        r = httpx.post(url + "/v1/completions", json={"prompt": "POISON", "max_tokens": 2})
        assert r.status_code == 503
        wait_for(lambda: not app.state.engine.alive, "the loop to stop")
        for method, path in (
            ("GET", "/health"),
            ("GET", "/metrics"),
            ("POST", "/reset_prefix_cache"),
        ):
            _error(httpx.request(method, url + path), 503)


# ---------------------------------------------------------------------- item 2: bad input
@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested more than 64"),
        ('{"prompt": "hi", "stop": ' + "[" * 70 + "]" * 70 + "}", "nested more than 64"),
        ('{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}", "more than 4300 digits"),
        ('{"prompt": "hi", "seed": -' + "9" * 4400 + "}", "more than 4300 digits"),
        ('{"prompt": "hi"', "not valid JSON"),
    ],
)
def test_malformed_bodies_are_400(url: str, raw: str, needle: str) -> None:
    err = _error(_post(url, "/v1/completions", raw), 400)
    assert needle in err["message"] and err["type"] == "invalid_request_error"
    _healthy(url)


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", '{"prompt": "a\\udfffb"}', "prompt"),
        ("/v1/completions", '{"prompt": ["a\\ud800"]}', "prompt"),
        ("/v1/completions", '{"prompt": "ok", "stop": ["\\ud83d"]}', "stop"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "\\ud800"}]}',
            "messages",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
            "messages",
        ),
    ],
)
def test_lone_surrogates_are_400(url: str, path: str, raw: str, param: str) -> None:
    err = _error(_post(url, path, raw), 400)
    assert err["param"] == param and "surrogate" in err["message"]


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("logprobs", 2),
        ("echo", True),
        ("best_of", 3),
        ("suffix", "tail"),
        ("logit_bias", {"50": 10}),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("response_format", {"type": "json_object"}),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unsupported_openai_parameters_are_400_naming_them(
    url: str, name: str, value: object, path: str
) -> None:
    base: dict[str, Any] = {"max_tokens": 1}
    if path == "/v1/completions":
        base["prompt"] = "hi"
    else:
        base["messages"] = [{"role": "user", "content": "hi"}]
    err = _error(httpx.post(url + path, json={**base, name: value}), 400)
    assert err["param"] == name and name in err["message"]
    assert err["code"] == "unsupported_parameter"
    # the value that means "not used" is accepted
    off = {"logprobs": None, "echo": False, "best_of": 1, "suffix": None}.get(name)
    assert httpx.post(url + path, json={**base, name: off}).status_code == 200


def test_openapi_declares_bodies_and_error_responses(url: str) -> None:
    doc = httpx.get(url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model, field in (
        ("/v1/completions", "CompletionRequest", "prompt"),
        ("/v1/chat/completions", "ChatRequest", "messages"),
    ):
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model}" and field in schemas[model]["properties"]
        assert {"400", "413", "429", "503"} <= set(op["responses"])
        err = op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
        assert err.endswith("/ErrorResponse")
    assert schemas["CompletionRequest"]["properties"]["seed"]["anyOf"][0]["maximum"] == SEED_MAX
    assert "409" in doc["paths"]["/reset_prefix_cache"]["post"]["responses"]
    assert "503" in doc["paths"]["/metrics"]["get"]["responses"]


def test_unknown_routes_and_methods_are_openai_shaped(url: str) -> None:
    assert _error(httpx.get(url + "/v1/nothing"), 404)["code"] == "not_found"
    assert _error(httpx.get(url + "/v1/completions"), 405)["code"] == "method_not_allowed"
