"""The front over replicas running here (the fake model, KV events on ipc sockets), through the
official `openai` client: chat sessions streamed, usage added for the front and left out for the
client, errors in OpenAI's shape, a replica that goes away, and `kvreuse route` as a command."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

for _name, _extra in (("fastapi", "server"), ("uvicorn", "server"), ("openai", "test")):
    pytest.importorskip(
        _name, reason=f"the fleet front tests need {_name}: pip install -e '.[{_extra}]'"
    )

import openai  # noqa: E402
from test_front_util import command, metric, wait_until  # noqa: E402

from kvreuse.events import Publisher  # noqa: E402
from kvreuse.fleet.serving.dispatch import Dispatcher  # noqa: E402
from kvreuse.fleet.serving.front import create_front  # noqa: E402
from kvreuse.serve import fake_backend  # noqa: E402
from kvreuse.serve.app import create_app  # noqa: E402
from kvreuse.serve.server import ServerThread  # noqa: E402
from kvreuse.tokenizer import ByteTokenizer  # noqa: E402

SYSTEM = "You are a careful assistant. Answer in one short sentence, and say nothing else. " * 2


@dataclass
class Fleet:
    url: str
    replicas: list[ServerThread]
    publishers: list[Publisher]
    dispatcher: Dispatcher


def _replica(tmp: Path, i: int) -> tuple[ServerThread, Publisher]:
    backend = fake_backend()
    pub = Publisher(
        backend.mgr.geo, endpoint=f"ipc://{tmp}/r{i}", replay_endpoint=f"ipc://{tmp}/r{i}-replay"
    )
    thread = ServerThread(create_app(backend, kv_events=pub))
    thread.start()
    return thread, pub


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    started = [_replica(tmp_path, i) for i in range(2)]
    dispatcher = Dispatcher(fake_backend().mgr.config, "exact")
    for i, (thread, pub) in enumerate(started):
        dispatcher.add(
            f"replica-{i}", thread.url, pub.endpoint, replay_endpoint=pub.replay_endpoint
        )
    models = httpx.get(f"{started[0][0].url}/v1/models").json()["data"]
    # no health check during a test: what the front sees comes from the requests themselves
    app = create_front(dispatcher, ByteTokenizer(), models=models, health_interval=3600)
    front = ServerThread(app)
    front.start()
    try:
        yield Fleet(front.url, [t for t, _ in started], [p for _, p in started], dispatcher)
    finally:
        front.stop()
        for thread, _ in started:
            thread.stop()
        dispatcher.close()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)


def _chat_turn(
    client: openai.OpenAI, messages: list[dict], usage: bool
) -> tuple[str, int | None, list]:
    """One streamed turn: (replica, predicted cached tokens, chunks)."""
    raw = client.chat.completions.with_raw_response.create(
        model="kvreuse-fake",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True} if usage else None,  # type: ignore[arg-type]
    )
    chunks = list(raw.parse())
    predicted = raw.headers.get("x-kvreuse-predicted-cached-tokens")
    return raw.headers["x-kvreuse-replica"], None if predicted is None else int(predicted), chunks


def _messages(session: int, turn: int) -> list[dict]:
    out = [{"role": "system", "content": f"Session {session}. " + SYSTEM}]
    for t in range(turn):
        out += [{"role": "user", "content": f"question {t} of {session}"}]
        out += [{"role": "assistant", "content": f"answer {t}"}]
    return [*out, {"role": "user", "content": f"question {turn} of {session}"}]


def test_streamed_chat_sessions_follow_the_cache_and_predictions_are_exact(fleet: Fleet) -> None:
    """Each session's first turn is first sent to a replica directly, behind the front's back:
    the front learns it from the events alone and sends the session there."""
    for session in range(4):
        direct = _client(fleet.replicas[session % 2].url)
        messages = _messages(session, 0)
        direct.chat.completions.create(model="kvreuse-fake", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    for pub in fleet.publishers:
        assert pub.flush()
    fleet.dispatcher.refresh()
    client = _client(fleet.url)
    for turn in range(3):
        for session in range(4):
            asked = session < 2
            replica, predicted, chunks = _chat_turn(client, _messages(session, turn), asked)
            assert replica == f"replica-{session % 2}"
            assert predicted is not None and predicted > 0
            usage = [c.usage for c in chunks if c.usage is not None]
            if asked:  # the client's usage chunk, with what the front predicted
                assert len(usage) == 1 and chunks[-1].choices == []
                assert usage[0].prompt_tokens_details.cached_tokens == predicted
            else:  # the usage the front asked for is not passed on
                assert usage == [] and all(c.choices for c in chunks)
    scrape = httpx.get(f"{fleet.url}/metrics").text
    for name in ("replica-0", "replica-1"):
        assert metric(scrape, "kvreuse:fleet_predicted_requests_total", replica=name) == 6
        predicted = metric(scrape, "kvreuse:fleet_predicted_cached_tokens_total", replica=name)
        delivered = metric(scrape, "kvreuse:fleet_prediction_delivered_tokens_total", replica=name)
        assert predicted == delivered > 0
        assert metric(scrape, "kvreuse:fleet_mispredicted_requests_total", replica=name) == 0


def test_errors_come_back_in_openai_shape(fleet: Fleet) -> None:
    cases = [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", json.dumps({"prompt": "x", "logprobs": 3}).encode(), 400),
        ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400),
        ("/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode(), 400),
        ("/v1/nothing", b"{}", 404),
    ]
    for path, body, status in cases:
        r = httpx.post(fleet.url + path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    # what only the replica can judge is its answer, passed through
    r = httpx.post(fleet.url + "/v1/completions", json={"prompt": "hi", "model": "other"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
    assert "x-kvreuse-replica" in r.headers
    # a prompt the router cannot hash (an id past 2**32) still gets the replica's answer
    r = httpx.post(fleet.url + "/v1/completions", json={"prompt": [1, 2**40]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]


def test_a_replica_that_goes_away_fails_nothing_and_leaves_rotation(fleet: Fleet) -> None:
    client = _client(fleet.url)
    first = client.completions.with_raw_response.create(
        model="kvreuse-fake", prompt=SYSTEM, max_tokens=2, temperature=0
    )
    home = first.headers["x-kvreuse-replica"]
    index = int(home.rsplit("-", 1)[1])
    fleet.replicas[index].stop()  # its port closes: nothing can be sent there any more
    again = client.completions.with_raw_response.create(
        model="kvreuse-fake", prompt=SYSTEM, max_tokens=2, temperature=0
    )
    assert again.headers["x-kvreuse-replica"] != home  # went elsewhere instead of failing
    assert again.parse().usage.prompt_tokens_details.cached_tokens == 0
    status = httpx.get(f"{fleet.url}/fleet/replicas").json()["replicas"]
    assert [r["up"] for r in status] == [i != index for i in range(2)]
    assert httpx.get(f"{fleet.url}/health").json()["replicas_up"] == 1
    fleet.replicas[1 - index].stop()
    r = httpx.post(fleet.url + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
    assert httpx.get(f"{fleet.url}/health").status_code == 503
    scrape = httpx.get(f"{fleet.url}/metrics").text
    for name in ("replica-0", "replica-1"):
        assert metric(scrape, "kvreuse:fleet_replica_up", replica=name) == 0
        assert metric(scrape, "kvreuse:fleet_failed_requests_total", replica=name) == 1


def test_kvreuse_route_fronts_running_replicas(tmp_path: Path) -> None:
    """The command, the geometry read from the first replica, and a session that a replica
    holds from a request sent to it directly (the front learns it from its events)."""
    started = [_replica(tmp_path, i) for i in range(2)]
    args = ["route", "--port", "0", "--health-interval", "0.2"]
    for thread, pub in started:
        args += ["--replica", f"{thread.url},{pub.endpoint},{pub.replay_endpoint}"]

    def prompt(session: int, n: int) -> str:
        return f"session {session}: " + SYSTEM + " more" * n

    try:
        with command(args, "kvreuse route:", timeout=60) as url:
            _client(started[1][0].url).completions.create(
                model="kvreuse-fake", prompt=prompt(1, 0), max_tokens=2, temperature=0
            )
            assert started[1][1].flush()
            wait_until(  # the front's health loop catches up quiet replicas
                lambda: (
                    httpx.get(f"{url}/fleet/replicas").json()["replicas"][1]["event_batches"]
                    == started[1][1].next_seq
                )
            )
            client = _client(url)
            homes, predictions = [], []
            for n in range(2):
                for session in range(3):
                    raw = client.completions.with_raw_response.create(
                        model="kvreuse-fake", prompt=prompt(session, n), max_tokens=2, temperature=0
                    )
                    usage = raw.parse().usage
                    predicted = int(raw.headers["x-kvreuse-predicted-cached-tokens"])
                    assert predicted == usage.prompt_tokens_details.cached_tokens
                    homes.append(raw.headers["x-kvreuse-replica"])
                    predictions.append(predicted)
            assert homes[:3] == homes[3:] and homes[1] == "replica-1"
            assert [p > 0 for p in predictions] == [False, True, False, True, True, True]
    finally:
        for thread, _ in started:
            thread.stop()


def test_a_replica_that_comes_back_is_followed_from_scratch(tmp_path: Path) -> None:
    """Restarted on the same port and sockets, a replica holds nothing and numbers its event
    batches from 0 again: the front puts it back in rotation with a fresh mirror, so it
    predicts no reuse there (the old mirror would promise the lost cache)."""
    thread, pub = _replica(tmp_path, 0)
    dispatcher = Dispatcher(fake_backend().mgr.config, "exact")
    dispatcher.add("replica-0", thread.url, pub.endpoint, replay_endpoint=pub.replay_endpoint)
    front = ServerThread(create_front(dispatcher, ByteTokenizer(), health_interval=0.05))
    url = front.start()
    client = _client(url)

    def send() -> tuple[int, int]:
        raw = client.completions.with_raw_response.create(
            model="kvreuse-fake", prompt=SYSTEM, max_tokens=2, temperature=0
        )
        cached = raw.parse().usage.prompt_tokens_details.cached_tokens
        return int(raw.headers["x-kvreuse-predicted-cached-tokens"]), cached

    def up() -> bool:
        return bool(httpx.get(f"{url}/fleet/replicas").json()["replicas"][0]["up"])

    try:
        send()
        predicted, cached = send()
        assert predicted == cached > 0
        port = thread.port
        thread.stop()
        wait_until(lambda: not up())
        backend = fake_backend()
        pub = Publisher(backend.mgr.geo, endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint)
        thread = ServerThread(create_app(backend, kv_events=pub), port=port)
        thread.start()
        wait_until(up)
        assert send() == (0, 0)
        predicted, cached = send()
        assert predicted == cached > 0
    finally:
        front.stop()
        thread.stop()
        dispatcher.close()
