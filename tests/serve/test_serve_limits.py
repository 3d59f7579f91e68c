"""Resource bounds: body size (413), token lists checked before per-token work, validation off
the event loop, clients that stop reading, and disconnects mid-body."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvreuse.serve import fake_backend
from kvreuse.serve.app import create_app
from kvreuse.serve.server import ServerThread
from kvreuse.tokenizer import ByteTokenizer
from serve_util import wait_for

MODEL = "kvreuse-fake"


def test_a_body_over_the_limit_is_413_declared_or_chunked() -> None:
    with ServerThread(create_app(fake_backend(), max_body_bytes=1000)) as url:
        big = {"prompt": "x" * 1500, "max_tokens": 1}
        r = httpx.post(url + "/v1/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert "1000 bytes" in r.json()["error"]["message"]

        def chunks() -> Iterator[bytes]:  # no content-length: chunked transfer encoding
            yield b'{"prompt": "'
            for _ in range(30):
                yield b"y" * 100
            yield b'", "max_tokens": 1}'

        r = httpx.post(url + "/v1/completions", content=chunks())
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        small = httpx.post(url + "/v1/completions", json={"prompt": "x" * 500, "max_tokens": 1})
        assert small.status_code == 200


def test_a_token_list_longer_than_the_context_is_refused_before_checking_tokens() -> None:
    with ServerThread(create_app(fake_backend())) as url:
        # element 2999 is not a token at all; the length alone decides
        prompt: list[Any] = [1] * 2999 + ["x"]
        r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"


class GatedTokenizer(ByteTokenizer):
    """`encode` blocks until released (a slow tokenisation of a large prompt)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: str) -> list[int]:
        self.entered.set()
        assert self.release.wait(30)
        return super().encode(text)


def test_validation_runs_off_the_event_loop() -> None:
    backend = fake_backend()
    tok = GatedTokenizer()
    backend.tokenizer = tok
    with ServerThread(create_app(backend)) as url:
        answer: list[httpx.Response] = []
        body = {"prompt": "a prompt that takes long to tokenise", "max_tokens": 2}
        t = threading.Thread(
            target=lambda: answer.append(httpx.post(url + "/v1/completions", json=body, timeout=30))
        )
        t.start()
        try:
            assert tok.entered.wait(10)
            # the event loop answers while the tokenizer works (it would time out otherwise)
            assert httpx.get(url + "/health", timeout=5).status_code == 200
            assert httpx.get(url + "/v1/models", timeout=5).status_code == 200
        finally:
            tok.release.set()
            t.join(30)
        assert answer[0].status_code == 200


def test_a_client_that_stops_reading_a_stream_is_cut_off() -> None:
    """With one request slot, a stalled reader would block every later request (429)."""
    app = create_app(fake_backend(), max_pending=1, stream_stall_timeout=0.5)
    server = ServerThread(app)
    server.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # inherited on accept
    with server as url:
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.connect((server.host, server.port))
        body = b'{"prompt": "stall", "max_tokens": 1900, "stream": true, "ignore_eos": true}'
        raw.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        try:
            # the slot is freed once the stalled stream is given up (before: 429 for ever)
            def served() -> bool:
                r = httpx.post(url + "/v1/completions", json={"prompt": "next", "max_tokens": 1})
                assert r.status_code in (200, 429), r.text
                return r.status_code == 200

            wait_for(served, "the stalled stream to be cut off", timeout=60)
            received = b""
            raw.settimeout(30)
            while chunk := raw.recv(65536):  # the server closed the connection
                received += chunk
            assert received.startswith(b"HTTP/1.1 200") and not received.endswith(b"[DONE]\n\n")
        finally:
            raw.close()
        wait_for(lambda: app.state.engine.pending == 0, "the slot to be released")


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_disconnect_mid_body_is_one_log_line(path: str) -> None:
    handler = Records()
    loggers = [logging.getLogger(n) for n in ("kvreuse.serve", "uvicorn.error", "uvicorn")]
    server = ServerThread(create_app(fake_backend()))
    with server:
        for lg in loggers:
            lg.addHandler(handler)
        old_level = loggers[0].level
        loggers[0].setLevel(logging.INFO)
        try:
            raw = socket.create_connection((server.host, server.port))
            raw.sendall(
                f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                "content-length: 100000\r\n\r\n".encode()
                + b'{"prompt": "only part of'
            )
            raw.close()

            def logged() -> bool:
                return any("disconnected" in r.getMessage() for r in handler.records)

            wait_for(logged, "the disconnect to be logged")
            assert httpx.get(server.url + "/health").status_code == 200
        finally:
            loggers[0].setLevel(old_level)
            for lg in loggers:
                lg.removeHandler(handler)
    lines = [r for r in handler.records if r.levelno >= logging.INFO]
    assert len([r for r in lines if "disconnected" in r.getMessage()]) == 1
    assert not [r for r in handler.records if r.exc_info or r.levelno >= logging.ERROR]
