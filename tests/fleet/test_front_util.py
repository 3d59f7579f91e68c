"""Helpers of the fleet front tests (no tests here): processes that print their URL, and the
agent workload driven through the official `openai` client."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvreuse.sim.generators import agent
from kvreuse.sim.workload import parse_line, tokens_of

openai = pytest.importorskip("openai", reason="fleet tests need openai: pip install -e '.[test]'")

BYTE_VOCAB = 256  # the embedded model's byte tokenizer: ids 0…255 are text, 256 is eos


@contextmanager
def command(
    args: Sequence[str],
    url_line: str,
    timeout: float = 240.0,
    program: Sequence[str] = (sys.executable, "-m", "kvreuse"),
    env: dict[str, str] | None = None,
    seen: list[str] | None = None,
) -> Iterator[str]:
    """Run `python -m kvreuse ARGS` (or `program ARGS`), yield the URL from its line
    `url_line … on URL/v1`, and stop it with SIGTERM (then SIGKILL) at the end; its output is
    kept for failures, and every line goes to `seen` when given."""
    proc = subprocess.Popen(
        [*program, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
    )
    pattern = re.compile(rf"^{re.escape(url_line)}.* on (http://\S+)/v1$")
    tail: collections.deque[str] = collections.deque(maxlen=40)
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            if seen is not None:
                seen.append(line.rstrip())
            m = pattern.match(line.rstrip())
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        ready.wait(timeout)
        assert found, f"{' '.join(args)} did not start:\n" + "\n".join(tail)
        yield found[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(5)
        if proc.stdout is not None:
            proc.stdout.close()


SLOW_SERVER = Path(__file__).parents[1] / "serve" / "slow_server.py"


@contextmanager
def slow_replica(drain_timeout: float = 1.0) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A `kvreuse serve` of the fake model whose steps take 10 ms, as a child process (to be
    frozen with SIGSTOP): yields it and its URL once /health answers; continued and killed at
    the end whatever happened."""
    proc = subprocess.Popen(
        [sys.executable, str(SLOW_SERVER), str(drain_timeout)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the slow server printed no port"
        url = f"http://127.0.0.1:{proc.stdout.readline().strip()}"

        def up() -> bool:
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, timeout=60)
        yield proc, url
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


@dataclass
class Turn:
    session: int
    turn: int
    replica: str | None
    predicted: int | None
    cached: int
    prompt_tokens: int
    predicted_by_medium: dict[str, int] | None = None  # the front's header, when it predicts
    cached_by_medium: dict[str, int] | None = None  # the replica's, when it has tiers
    exact: bool = False  # the front's x-kvreuse-mirror-exact


def agent_turns(sessions: int, turns: int) -> list[list[dict]]:
    """The agent workload's requests grouped by turn (all sessions' turn 0 first)."""
    lines = agent(sessions, turns, user_len=32, tool_len=16, max_tokens=4, seed=3)
    by_turn: list[list[dict]] = [[] for _ in range(turns)]
    for line in lines:
        s, t = (int(x[1:]) for x in line["id"].split("-"))
        by_turn[t].append({"session": s, "turn": t, "line": line})
    return by_turn


def run_agent(url: str, sessions: int = 8, turns: int = 6) -> list[Turn]:
    """Every session's turn 0 at once (so the front spreads them by load), then turns 1… one
    request at a time, sessions interleaved. Prompts are token ids in the byte vocabulary; each
    turn quotes the previous turn's prompt and answer."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    history: dict[str, list[int]] = {}
    out: list[Turn] = []

    def send(item: dict) -> tuple[str, list[int], Turn]:
        req = parse_line(item["line"], 1)
        tokens = [t % BYTE_VOCAB for t in tokens_of(req.prompt, history)]
        raw = client.completions.with_raw_response.create(
            model=model,
            prompt=tokens,
            max_tokens=req.max_tokens,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        completion = raw.parse()
        choice = completion.choices[0]
        generated = (choice.model_extra or {})["token_ids"]
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        predicted = raw.headers.get("x-kvreuse-predicted-cached-tokens")
        by_medium = raw.headers.get("x-kvreuse-predicted-cached-tokens-by-medium")
        turn = Turn(
            item["session"],
            item["turn"],
            raw.headers.get("x-kvreuse-replica"),
            None if predicted is None else int(predicted),
            usage.prompt_tokens_details.cached_tokens or 0,
            usage.prompt_tokens,
            None if by_medium is None else _by_medium(by_medium),
            (usage.prompt_tokens_details.model_extra or {}).get("cached_tokens_by_medium"),
            raw.headers.get("x-kvreuse-mirror-exact") == "true",
        )
        return req.request_id, tokens + generated, turn

    by_turn = agent_turns(sessions, turns)
    with ThreadPoolExecutor(len(by_turn[0])) as pool:
        results = list(pool.map(send, by_turn[0]))
    for items in [None, *by_turn[1:]]:
        if items is not None:
            results = [send(item) for item in items]
        for rid, full, turn in results:
            history[rid] = full
            out.append(turn)
    client.close()
    return out


def _by_medium(header: str) -> dict[str, int]:
    return {m: int(n) for m, n in (part.split("=") for part in header.split(","))}


def metric(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        base, _, rest = key.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if base == name and got == want:
            return float(value)
    raise KeyError(f"{name}{{{want}}} not in the exposition")


def wait_until(check: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)
