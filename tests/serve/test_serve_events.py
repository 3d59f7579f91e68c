"""KV events from a live server: `kvreuse serve --kv-events-*` publishes what a subscriber
mirrors exactly; without the option the manager records nothing; a failing publisher never
stops the step loop; the publisher is closed when the server stops; bad options are one line."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

zmq = pytest.importorskip("zmq", reason="KV event tests need pyzmq: pip install -e '.[events]'")

pytest.importorskip("msgspec", reason="KV event tests need msgspec: pip install -e '.[events]'")

from kvreuse.cli import main  # noqa: E402
from kvreuse.core import Event, KVCacheManager, compute_lookup  # noqa: E402
from kvreuse.deployment import resolve  # noqa: E402
from kvreuse.events import HashChain, Publisher, Subscriber  # noqa: E402
from kvreuse.serve import fake_backend  # noqa: E402
from kvreuse.serve.app import create_app  # noqa: E402
from kvreuse.serve.server import ServerThread  # noqa: E402
from kvreuse.sim.generators import agent, shared_prefix  # noqa: E402
from kvreuse.sim.workload import VOCAB, parse_line, resolve_prompt  # noqa: E402

KVREUSE = Path(sys.executable).with_name("kvreuse")


def loopback(endpoint: str) -> str:
    return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]


def complete(url: str, model: str, tokens: list[int], max_tokens: int) -> tuple[int, list[int]]:
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["usage"]["prompt_tokens_details"]["cached_tokens"], data["choices"][0]["token_ids"]


def sync(sub: Subscriber, pub: Publisher, timeout: float = 10.0) -> None:
    """Wait until `sub` has applied every batch `pub` has sent."""
    assert pub.flush(timeout)
    stream = sub.stream("r")
    deadline = time.monotonic() + timeout
    while stream.next_seq < pub.next_seq:
        assert time.monotonic() < deadline, f"subscriber at {stream.next_seq} of {pub.next_seq}"
        if not sub.poll(50):
            sub.catch_up("r")  # batches sent before the subscription reached the publisher
    assert stream.exact


def workload() -> list[dict[str, object]]:
    return agent(
        sessions=2, turns=6, user_len=40, tool_len=20, max_tokens=4, seed=3
    ) + shared_prefix(prefix_len=100, suffix_len=30, requests=8, max_tokens=4, seed=4)


@pytest.mark.parametrize(
    ("geometry", "num_blocks"), [(None, None), (None, 40), ("tiny-sliding-hybrid", None)]
)
def test_a_subscriber_mirrors_a_live_server_exactly(
    geometry: str | None, num_blocks: int | None
) -> None:
    """Before every request of an agent and a shared-prefix workload (one at a time), the
    core's lookup run on the subscriber's mirror predicts the cached tokens the server then
    reports: on the fake DCP4 hybrid (also in a pool small enough to evict) and on a
    sliding-window hybrid."""
    backend = replace(fake_backend(geometry, num_blocks=num_blocks), vocab_size=VOCAB)
    geo = backend.mgr.geo
    hasher = KVCacheManager(backend.mgr.config).hasher  # the router hashes prompts itself
    pub = Publisher(geo, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    with (
        ServerThread(create_app(backend, kv_events=pub)) as url,
        Subscriber() as sub,
    ):
        mirror = sub.add_replica(
            "r", geo, loopback(pub.endpoint), replay_endpoint=loopback(pub.replay_endpoint or "")
        )
        history: dict[str, list[int]] = {}
        cached_total = 0
        for lineno, obj in enumerate(workload(), 1):
            req = parse_line(obj, lineno)
            tokens = resolve_prompt(req.prompt, history)
            sync(sub, pub)
            chain = HashChain(hasher.hash_units(tokens))
            predicted = compute_lookup(geo, mirror, req.request_id, chain, len(tokens)).hit
            cached, output = complete(url, backend.name, tokens, req.max_tokens)
            assert (req.request_id, predicted) == (req.request_id, cached)
            history[req.request_id] = tokens + output
            cached_total += cached
    assert cached_total > 0 and pub.dropped_batches == 0


def test_without_events_the_manager_records_none() -> None:
    backend = fake_backend()
    with ServerThread(create_app(backend)) as url:
        for _ in range(2):
            complete(url, backend.name, list(range(1, 200)), 4)
        recording = backend.mgr.events.enabled
        pending = len(backend.mgr.events.pending)
    assert not recording and pending == 0


class Sink:
    """A stand-in publisher: records batches, or raises on every `fail`-th publish."""

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.batches: list[Sequence[Event]] = []
        self.calls = 0
        self.closed_after: int | None = None

    def publish(self, events: Sequence[Event]) -> None:
        self.calls += 1
        if self.fail and self.calls % self.fail == 0:
            raise RuntimeError("the socket is gone")
        self.batches.append(events)

    def close(self, timeout: float = 1.0) -> None:
        self.closed_after = self.calls


def test_a_failing_publish_never_stops_the_server() -> None:
    backend, sink = fake_backend(), Sink(fail=2)
    app = create_app(backend, kv_events=sink)
    with ServerThread(app) as url:
        for i in range(6):
            cached, _ = complete(url, backend.name, [7, 8, 9] * 40 + [i + 1], 4)
            assert cached > 0 or i == 0
        failed = app.state.engine.stats.failed_publishes
        assert httpx.get(url + "/health").status_code == 200
    assert failed > 0 and sink.batches
    assert sink.closed_after == sink.calls  # closed once the loop had stopped publishing


def test_the_publisher_is_closed_after_the_last_batch_when_the_server_stops() -> None:
    backend, sink = fake_backend(), Sink()
    with ServerThread(create_app(backend, kv_events=sink)) as url:
        complete(url, backend.name, list(range(1, 100)), 4)
        assert sink.closed_after is None
    assert sink.closed_after == sink.calls > 0


def _serve(*argv: str) -> subprocess.Popen[str]:
    cmd = [str(KVREUSE), "serve", "--fake", "--port", "0", *argv]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_kvreuse_serve_publishes_to_a_subscriber_it_connects_to() -> None:
    """vLLM's socket semantics: a specific address connects to a subscriber bound there (the
    router binds); the replay endpoint binds. On SIGTERM the app's shutdown closes it."""
    geo = resolve("tiny-attention").cache.geometry
    with Subscriber() as sub:
        sub.add_replica("r", geo, "tcp://127.0.0.1:0", bind=True)
        bound = sub.stream("r").sub.getsockopt_string(zmq.LAST_ENDPOINT)
        argv = ["--geometry", "tiny-attention", "--kv-events-endpoint", bound]
        argv += ["--kv-events-replay-endpoint", "tcp://127.0.0.1:0", "--kv-events-topic", "kv@p@m"]
        with _serve(*argv) as proc:
            try:
                assert proc.stderr is not None
                lines = [proc.stderr.readline() for _ in range(2)]
                url = re.search(r"http://\S+?(?=/v1)", lines[0])
                assert url is not None, lines
                assert f"KV events (groups) on {bound}, replay on tcp://127.0.0.1:" in lines[1]
                stream = sub.stream("r")
                for i in range(200):  # until the connection is up and a batch has come through
                    prompt = [i % 200 + 1, *range(1, 60)]  # new blocks each time: a new batch
                    complete(url.group(0), "kvreuse-fake", prompt, 2)
                    if sub.poll(100):
                        break
                assert stream.num_batches > 0 and sub.mirror("r").entries(0)
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal
                assert "Application shutdown complete" in proc.stderr.read()  # publisher closed
            finally:
                if proc.poll() is None:
                    proc.kill()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--kv-events-mode", "routable"], "--kv-events-mode needs --kv-events-endpoint"),
        (["--kv-events-topic", "t"], "--kv-events-topic needs --kv-events-endpoint"),
        (["--kv-events-endpoint", "udp://x:1"], "--kv-events-endpoint: expected tcp://HOST:PORT"),
        (["--kv-events-endpoint", "tcp://*:70000"], "PORT in [0, 65535]"),
        (
            ["--kv-events-endpoint", "tcp://*:0", "--kv-events-replay-endpoint", "tcp://*:0"],
            "--kv-events-replay-endpoint must differ",
        ),
        (
            ["--kv-events-endpoint", "tcp://*:0", "--kv-events-buffer-steps", "0"],
            "--kv-events-buffer-steps must be at least 1, got 0",
        ),
        (
            ["--kv-events-endpoint", "tcp://*:0", "--kv-events-mode", "all"],
            "--kv-events-mode must be one of groups, routable, legacy, got 'all'",
        ),
    ],
)
def test_bad_kv_events_options_are_one_line_and_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--fake", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err and err.startswith("kvreuse serve: "), err


def test_a_busy_kv_events_port_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    busy = Publisher(resolve("tiny-attention").cache.geometry, endpoint="tcp://*:0")
    try:
        port = busy.endpoint.rsplit(":", 1)[1]
        assert (
            main(["serve", "--fake", "--port", "0", "--kv-events-endpoint", f"tcp://*:{port}"]) == 2
        )
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot open KV event endpoint" in err, err
    assert err.startswith("kvreuse serve: ")
