"""The front's parts without servers: the stream relay (usage read and left out, a replica that
breaks off), the dispatcher around replicas that are down, and the commands' option errors."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

for _name, _extra in (("fastapi", "server"), ("httpx", "server")):
    pytest.importorskip(
        _name, reason=f"fleet front tests need {_name}: pip install -e '.[{_extra}]'"
    )

import httpx  # noqa: E402

from kvreuse.cli import main  # noqa: E402
from kvreuse.deployment import resolve  # noqa: E402
from kvreuse.fleet.serving.dispatch import Dispatcher, NoReplica  # noqa: E402
from kvreuse.fleet.serving.forward import Delivery, Flight, GaveUp, relay_stream  # noqa: E402


def _event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


CHUNK = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}], "usage": None}
USAGE = {
    "choices": [],
    "usage": {"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 8}},
}


class _Upstream(httpx.AsyncByteStream):
    def __init__(self, parts: list[bytes], error: Exception | None = None) -> None:
        self.parts, self.error = parts, error

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for part in self.parts:
            yield part
        if self.error is not None:
            raise self.error


def _relay(
    parts: list[bytes], strip: bool, error: Exception | None = None
) -> tuple[bytes, Delivery]:
    got: list[Delivery] = []

    async def run() -> bytes:
        resp = httpx.Response(200, stream=_Upstream(parts, error))
        out = b""
        async for piece in relay_stream(resp, "replica-0", strip, got.append):
            out += piece
        return out

    out = asyncio.run(run())
    assert len(got) == 1
    return out, got[0]


def test_the_relay_reads_usage_and_leaves_out_what_the_client_did_not_ask_for() -> None:
    whole = _event(CHUNK) + _event(USAGE) + b"data: [DONE]\n\n"
    parts = [whole[i : i + 7] for i in range(0, len(whole), 7)]  # events split anywhere
    out, delivery = _relay(parts, strip=True)
    assert out == _event(CHUNK) + b"data: [DONE]\n\n"
    assert delivery == Delivery(cached_tokens=8, failed=False)
    out, delivery = _relay(parts, strip=False)
    assert out == whole and delivery.cached_tokens == 8


@pytest.mark.parametrize("error", [httpx.ReadError("connection reset"), None])
def test_a_stream_the_replica_breaks_off_ends_with_an_error_and_done(
    error: Exception | None,
) -> None:
    out, delivery = _relay([_event(CHUNK)], strip=True, error=error)
    events = out.split(b"\n\n")
    assert events[0] == _event(CHUNK).strip() and events[-2:] == [b"data: [DONE]", b""]
    err = json.loads(events[1][6:])["error"]
    assert err["code"] == "replica_failed" and "replica-0" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    assert delivery.failed and delivery.cached_tokens is None


def test_the_dispatcher_never_routes_to_a_replica_that_is_down(tmp_path: Path) -> None:
    config = resolve("tiny-attention").cache
    for policy in ("exact", "round-robin", "text-prefix"):
        d = Dispatcher(config, policy)
        try:
            members = [d.add(f"r{i}", f"http://r{i}", f"ipc://{tmp_path}/{i}") for i in range(3)]
            d.mark_down(members[0], "gone")
            for i in range(6):
                routed = d.route(list(range(1, 40)), request_id=f"q{i}")
                assert routed.member is not members[0]
                d.done(routed)
            routed = d.route([1, 2, 3], exclude=frozenset({1}))
            assert routed.member is members[2]
            d.mark_down(members[1], "gone")
            d.mark_down(members[2], "gone")
            with pytest.raises(NoReplica, match="r0: gone"):
                d.route([1, 2, 3])
        finally:
            d.close()


def test_in_flight_requests_are_the_load() -> None:
    d = Dispatcher(resolve("tiny-attention").cache, "least-loaded")
    try:
        a = d.add("a", "http://a", "ipc:///nonexistent/a")
        b = d.add("b", "http://b", "ipc:///nonexistent/b")
        first = d.route(list(range(1, 100)))
        second = d.route(list(range(1, 10)))
        assert (first.member, second.member) == (a, b)
        assert (a.tokens_in_flight, b.tokens_in_flight) == (99, 9)
        d.done(first)
        assert (a.num_in_flight, a.tokens_in_flight) == (0, 0)
        assert d.route([5, 6]).member is a
    finally:
        d.close()


def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


# Were the refusal missed, the replicas would fail to start in time rather than run.
_FLEET = ["fleet", "--replicas", "2", "--fake", "--quiet-replicas", "--start-timeout", "0.01", "--"]
_ROUTE = ["--replica", "http://h:1,tcp://h:2"]
_MODE = "--kv-events-mode"
_SET = "is set by kvreuse fleet for each replica"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["fleet", "--replicas", "2", "--", "--port", "9"], "--port is set by kvreuse fleet"),
        (["fleet", "--replicas", "2", "--", "--geometry", "x"], "give it before --"),
        # after --, what serve's own parser would take for a fleet option, however spelled
        ([*_FLEET, "--kv-events-mo", "routable"], f"--kv-events-mo (taken as {_MODE}) {_SET}"),
        ([*_FLEET, "--kv-events-mo=routable"], f"--kv-events-mo (taken as {_MODE}) {_SET}"),
        ([*_FLEET, "--kv-events-mode=groups"], f"{_MODE} {_SET}"),
        ([*_FLEET, "--po=9"], f"--po (taken as --port) {_SET}"),
        ([*_FLEET, "--metrics-p", "9"], f"--metrics-p (taken as --metrics-port) {_SET}"),
        ([*_FLEET, "--fak"], "--fak (taken as --fake) is an option of kvreuse fleet"),
        ([*_FLEET, "--num-b", "9"], "--num-b (taken as --num-blocks) is an option of"),
        ([*_FLEET, "--no-such-option"], "after --: unrecognized arguments: --no-such-option"),
        ([*_FLEET, "--met", "9"], "after --: ambiguous option: --met could match"),
        (["fleet", "--replicas", "2", "--stall-timeout", "0"], "--stall-timeout must be"),
        (["fleet", "--replicas", "2", "--first-byte-timeout", "inf"], "--first-byte-timeout"),
        (["route", *_ROUTE, "--answer-timeout", "nan"], "--answer-timeout must be a number"),
        (["route", *_ROUTE, "--connect-timeout", "-1"], "--connect-timeout must be a number"),
        (["fleet", "--replicas", "2", "--metrics-port", "70000"], "--metrics-port must be a TCP"),
        (["route", *_ROUTE, "--port", "9", "--metrics-port", "9"], "--metrics-port must differ"),
        (["route", *_ROUTE, "--admin-token", " "], "--admin-token must not be empty"),
        (["fleet", "--replicas", "2", "--load-weight", "nan"], "--load-weight: must be a finite"),
        (["fleet", "--replicas", "2", "--geometry", "nope"], "nope"),
        (["route", "--replica", "http://h:1"], "URL,EVENTS_ENDPOINT"),
        (["route", "--replica", "ftp://h:1,tcp://h:2"], "http://"),
        (["route", "--replica", "http://h:1,tcp://h:99999"], "PORT in [0, 65535]"),
        (["route", "--replica", "http://127.0.0.1:9,tcp://h:2"], "pass --geometry"),
        (
            ["route", "--replica", "http://a:1,tcp://h:2", "--replica", "http://a:1,tcp://h:3"],
            "given twice",
        ),
    ],
)
def test_bad_options_are_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # refused as the option is read
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and needle in err and err.startswith(f"kvreuse {argv[0]}: ")


def test_a_busy_port_and_a_replica_that_cannot_start_are_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with _busy_port() as busy:
        port = str(busy.getsockname()[1])
        argv = ["route", "--replica", "http://127.0.0.1:9,tcp://127.0.0.1:2"]
        assert main([*argv, "--geometry", "tiny-attention", "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot listen on 127.0.0.1:" in err
    argv = ["fleet", "--replicas", "1", "--fake", "--port", "0", "--quiet-replicas"]
    assert main([*argv, "--", "--max-body-bytes", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvreuse fleet: replica replica-0 exited (exit code 2): ")
    assert err[-1].endswith("--max-body-bytes must be at least 1, got 0")


def test_a_flight_gives_up_at_its_deadline_or_at_once_when_ended_and_finishes_once() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        never = asyncio.Event()
        got: list[Delivery] = []
        flight = Flight("replica-0", got.append)
        with pytest.raises(GaveUp) as late:
            await flight.wait(never.wait, loop.time() + 0.05, "sent nothing")
        assert (late.value.status, late.value.code) == (504, "replica_timeout")
        waiting = asyncio.ensure_future(flight.wait(never.wait, loop.time() + 60, "sent nothing"))
        await asyncio.sleep(0.01)
        flight.end("no answer to a health check")
        with pytest.raises(GaveUp) as ended:
            await asyncio.wait_for(waiting, 5)
        assert (ended.value.status, ended.value.code) == (502, "replica_down")
        assert "no answer to a health check" in ended.value.message
        with pytest.raises(GaveUp):  # and every later wait
            await flight.wait(asyncio.sleep, loop.time() + 60, "x")
        flight.finish(Delivery(cached_tokens=3))
        flight.finish(Delivery(failed=True))
        assert got == [Delivery(cached_tokens=3)]

    asyncio.run(run())
