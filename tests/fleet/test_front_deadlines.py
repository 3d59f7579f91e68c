"""The front's deadlines on its replicas, against a real replica frozen with SIGSTOP (a child
process whose steps take 10 ms): a frozen replica costs a client the deadline, then a clean
error; a replica that stops answering its health checks has its requests ended; one that cannot
be connected to in time hands the request to another; a draining one keeps its requests. The
replica's in-flight count is back to 0 after each."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

for _name, _extra in (("fastapi", "server"), ("uvicorn", "server")):
    pytest.importorskip(_name, reason=f"front tests need {_name}: pip install -e '.[{_extra}]'")

from test_front_util import metric, slow_replica, wait_until  # noqa: E402

from kvreuse.fleet.serving.deadlines import Deadlines  # noqa: E402
from kvreuse.fleet.serving.dispatch import Dispatcher  # noqa: E402
from kvreuse.fleet.serving.front import create_front  # noqa: E402
from kvreuse.serve import fake_backend  # noqa: E402
from kvreuse.serve.app import create_app  # noqa: E402
from kvreuse.serve.server import ServerThread  # noqa: E402
from kvreuse.tokenizer import ByteTokenizer  # noqa: E402

LONG = {"prompt": "a frozen replica " * 4, "max_tokens": 1500}  # 15 s at 10 ms a step


@contextmanager
def front(
    tmp: Path, urls: list[str], policy: str = "exact", **kwargs: object
) -> Iterator[tuple[str, Dispatcher]]:
    """The front in-process over `urls` (KV events on ipc sockets nobody publishes on)."""
    dispatcher = Dispatcher(fake_backend().mgr.config, policy)
    for i, url in enumerate(urls):
        dispatcher.add(f"replica-{i}", url, f"ipc://{tmp}/events-{i}")
    kwargs.setdefault("health_interval", 3600.0)
    thread = ServerThread(create_front(dispatcher, ByteTokenizer(), **kwargs))  # type: ignore[arg-type]
    try:
        yield thread.start(), dispatcher
    finally:
        thread.stop()
        dispatcher.close()


def _events(body: str) -> list[dict]:
    parts = [p for p in body.split("\n\n") if p]
    assert parts[-1] == "data: [DONE]", body[-300:]
    return [json.loads(p.removeprefix("data: ")) for p in parts[:-1]]


def _in_flight(url: str) -> list[int]:
    rows = httpx.get(f"{url}/fleet/replicas").json()["replicas"]
    return [row["requests_in_flight"] for row in rows]


def test_a_replica_frozen_mid_stream_costs_the_stall_deadline(tmp_path: Path) -> None:
    with (
        slow_replica() as (proc, replica),
        front(tmp_path, [replica], deadlines=Deadlines(stall=0.5)) as (url, _),
    ):
        body = {**LONG, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=20) as r:
            assert r.status_code == 200
            text, stopped = "", None
            for chunk in r.iter_text():
                text += chunk
                if stopped is None and text.count("\n\n") >= 3:
                    proc.send_signal(signal.SIGSTOP)
                    stopped = time.monotonic()
        assert stopped is not None
        assert time.monotonic() - stopped < 5.0
        last = _events(text)[-1]
        assert (
            last["error"]["code"] == "replica_timeout" and "replica-0" in last["error"]["message"]
        )
        assert set(last["error"]) == {"message", "type", "param", "code"}
        assert _in_flight(url) == [0]
        scrape = httpx.get(f"{url}/metrics").text
        assert metric(scrape, "kvreuse:fleet_failed_requests_total", replica="replica-0") == 1


def test_a_frozen_replica_costs_a_new_request_the_first_byte_deadline(tmp_path: Path) -> None:
    deadlines = Deadlines(first_byte=0.5, answer=0.8)
    with (
        slow_replica() as (proc, replica),
        front(tmp_path, [replica], deadlines=deadlines) as (
            url,
            _,
        ),
    ):
        proc.send_signal(signal.SIGSTOP)  # its kernel still accepts connections
        for stream in (False, True):
            start = time.monotonic()
            r = httpx.post(f"{url}/v1/completions", json={**LONG, "stream": stream}, timeout=20)
            assert time.monotonic() - start < 5.0
            assert r.status_code == 504, r.text
            err = r.json()["error"]
            assert err["code"] == "replica_timeout" and err["type"] == "server_error"
            assert "replica-0" in err["message"]
        assert _in_flight(url) == [0]


def test_a_replica_that_stops_answering_health_checks_has_its_requests_ended(
    tmp_path: Path,
) -> None:
    """With the default deadlines (a minute and more), the health check ends them sooner."""
    with (
        slow_replica() as (proc, replica),
        front(tmp_path, [replica], health_interval=0.2) as (
            url,
            _,
        ),
    ):
        answers: dict[str, tuple[int, str]] = {}
        streaming = threading.Event()

        def send(name: str, stream: bool) -> None:
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**LONG, "stream": stream}, timeout=20
            ) as r:
                text = ""
                for chunk in r.iter_text():
                    streaming.set()
                    text += chunk
                answers[name] = (r.status_code, text)

        threads = [
            threading.Thread(target=send, args=(name, name == "stream"), daemon=True)
            for name in ("plain", "stream")
        ]
        for t in threads:
            t.start()
        assert streaming.wait(10)  # the stream has begun: it is ended by an error event
        wait_until(lambda: _in_flight(url) == [2])
        proc.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        for t in threads:
            t.join(15)
        assert time.monotonic() - stopped < 8.0, "the requests were not ended"
        (status, plain), (_, stream) = answers["plain"], answers["stream"]
        assert status == 502 and json.loads(plain)["error"]["code"] == "replica_down"
        assert _events(stream)[-1]["error"]["code"] == "replica_down"
        assert _in_flight(url) == [0]
        assert httpx.get(f"{url}/health").status_code == 503


def test_a_replica_that_cannot_be_connected_to_in_time_hands_the_request_on(
    tmp_path: Path,
) -> None:
    """A listener whose accept queue is full drops new connections: they hang, as to a host
    that is gone. The front gives up after --connect-timeout and sends the request elsewhere."""
    black = socket.socket()
    black.bind(("127.0.0.1", 0))
    black.listen(0)
    filler = socket.create_connection(black.getsockname(), timeout=5)  # the one free slot
    replica = ServerThread(create_app(fake_backend()))
    try:
        replica.start()
        urls = [f"http://127.0.0.1:{black.getsockname()[1]}", replica.url]
        deadlines = Deadlines(connect=0.3)
        with front(tmp_path, urls, "round-robin", deadlines=deadlines) as (url, _):
            start = time.monotonic()
            for _ in range(2):  # round-robin sends one of them to the black hole first
                r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
                assert r.status_code == 200 and r.headers["x-kvreuse-replica"] == "replica-1"
            assert time.monotonic() - start < 5.0
            rows = httpx.get(f"{url}/fleet/replicas").json()["replicas"]
            assert [row["up"] for row in rows] == [False, True]
            assert "ConnectTimeout" in rows[0]["why_down"]
            assert _in_flight(url) == [0, 0]
    finally:
        replica.stop()
        filler.close()
        black.close()


def test_a_draining_replica_keeps_its_requests(tmp_path: Path) -> None:
    """SIGTERM: the replica refuses new connections and answers /health 503 while its running
    requests finish; the front takes it out of rotation but leaves those requests alone."""
    with (
        slow_replica(drain_timeout=30) as (proc, replica),
        front(tmp_path, [replica], health_interval=0.1) as (url, _),
    ):
        body = {**LONG, "max_tokens": 200, "stream": True}  # about 2 s
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=20) as r:
            text = ""
            for chunk in r.iter_text():
                if not text:
                    proc.send_signal(signal.SIGTERM)
                text += chunk
        events = _events(text)
        assert all("error" not in e for e in events), events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 503)


def test_clients_that_leave_mid_stream_leave_no_load_behind(tmp_path: Path) -> None:
    """Wherever a client goes away (at the headers, after some events), the request leaves
    the replica's load and the front's connection to the replica is closed."""
    with slow_replica() as (_, replica), front(tmp_path, [replica]) as (url, _):
        body = {**LONG, "stream": True}
        for events in (0, 0, 1, 3, 0, 5):
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=20) as r:
                assert r.status_code == 200
                seen = 0
                for chunk in r.iter_raw():
                    seen += chunk.count(b"\n\n")
                    if seen >= events:
                        break
        wait_until(lambda: _in_flight(url) == [0], timeout=10)
        served = httpx.post(f"{url}/v1/completions", json={**LONG, "max_tokens": 2})
        assert served.status_code == 200
