"""Stop strings with the byte tokenizer: a stream never shows part of a stop string, a stop
string containing U+FFFD never matches a character still in progress, and streamed and
non-streamed text are equal."""

from __future__ import annotations

import codecs
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from depth import scaled
from kvreuse.sched import ScriptedEngine
from kvreuse.serve import fake_backend
from kvreuse.serve.app import create_app
from kvreuse.serve.detok import TextState, advance
from kvreuse.serve.server import ServerThread
from kvreuse.tokenizer import ByteTokenizer
from serve_util import ScriptTokens

TOK = ByteTokenizer()
PIECES = ["a", "b", "é", "€", "😀", "\ufffd", "ab"]


def reference(data: bytes, stops: list[str]) -> str:
    """Byte by byte through Python's incremental decoder (which holds back an incomplete
    sequence): the text ends before the first stop string to complete."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    head = ""
    for b in data:
        head += dec.decode(bytes([b]))
        hits = [(head.find(s) + len(s), head.find(s)) for s in stops if s in head]
        if hits:
            return head[: min(hits)[1]]
    return head + dec.decode(b"", final=True)


def stream(data: bytes, stops: list[str], cuts: list[int]) -> tuple[list[str], TextState]:
    state = TextState(tuple(s for s in stops if s))
    ids, pieces = list(data), []
    bounds = sorted({c % (len(ids) + 1) for c in cuts} | {len(ids)})
    for end in bounds:
        done = end == len(ids)
        pieces.append(advance(TOK, state, ids[:end], done))
        if state.stopped:
            break
    return pieces, state


byte_runs = st.lists(
    st.one_of(
        st.sampled_from([p.encode() for p in PIECES if p != "\ufffd"]),
        st.binary(min_size=1, max_size=3),  # invalid or partial sequences too
    ),
    max_size=12,
).map(b"".join)
stop_lists = st.lists(
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=3).map("".join), max_size=3
)


@settings(max_examples=scaled(300), deadline=None)
@given(byte_runs, stop_lists, st.lists(st.integers(0, 64), max_size=8))
def test_text_is_the_reference_however_tokens_are_grouped(
    data: bytes, stops: list[str], cuts: list[int]
) -> None:
    pieces, state = stream(data, stops, cuts)
    assert "".join(pieces) == state.text  # nothing emitted is ever taken back
    assert state.text == reference(data, stops)


@pytest.mark.parametrize(
    ("script", "stop", "text", "reason"),
    [
        (b"x\xc3\xa9yz", ["\ufffd"], "xéyz", "length"),  # é in progress is not U+FFFD
        (b"x\xc3yz", ["\ufffd"], "x", "stop"),  # a real invalid byte is
        (b"xa\xc3b!!", ["a\ufffdb"], "x", "stop"),  # split across four tokens
        (b"ab\xe2\x82\xacc", [b"\xe2\x82\xac".decode()], "ab", "stop"),  # € in three bytes
        (b"hello world", ["o w", "wor"], "hell", "stop"),
    ],
)
def test_streamed_and_plain_answers_agree(
    script: bytes, stop: list[str], text: str, reason: str
) -> None:
    backend = fake_backend()
    backend.scheduler.engine = ScriptedEngine(ScriptTokens(list(script)))
    body = {"prompt": "go", "max_tokens": len(script), "stop": stop}
    with ServerThread(create_app(backend)) as url:
        plain = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]
        events = httpx.post(url + "/v1/completions", json={**body, "stream": True}).text
    chunks = [json.loads(e[6:]) for e in events.split("\n\n") if e and e != "data: [DONE]"]
    streamed = "".join(c["choices"][0]["text"] for c in chunks)
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert plain["text"] == streamed == text
    assert plain["finish_reason"] == reasons[-1] == reason
