"""Helpers for the server tests: a gated engine (to hold the step loop still deterministically),
a metrics parser and a fixture-style server context."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from kvreuse.core import StepPlan


class GatedEngine:
    """Wraps an engine; while `paused`, each step blocks (and sets `blocked`) until resumed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.open = threading.Event()
        self.open.set()
        self.blocked = threading.Event()

    def pause(self) -> None:
        self.blocked.clear()
        self.open.clear()

    def resume(self) -> None:
        self.open.set()

    def __call__(self, step: StepPlan, seqs: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
        if not self.open.is_set():
            self.blocked.set()
            self.open.wait()
        return self.inner(step, seqs)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll a condition (not a sleep as synchronisation: it returns as soon as cond holds)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{([^}]*)\})? (\S+)$")


def scrape(url: str) -> dict[str, float]:
    """/metrics as {name or name{labels}: value}."""
    text = httpx.get(url + "/metrics").text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            key = m.group(1) + (f"{{{m.group(2)}}}" if m.group(2) else "")
            out[key] = float(m.group(3))
    return out


class PoisonEngine:
    """Wraps an engine; a step holding a request whose prompt starts with `POISON` raises."""

    MARK = (80, 79, 73, 83, 79, 78)  # b"POISON"

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, step: StepPlan, seqs: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
        for plan in step.requests:
            prompt = tuple(seqs[plan.request_id].request.prompt_token_ids[:6])
            if prompt == self.MARK:
                raise RuntimeError("the engine cannot run this request")
        return self.inner(step, seqs)


class SlowEngine:
    """Wraps an engine; each step takes at least `delay` seconds (a model's forward pass)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner = inner
        self.delay = delay

    def __call__(self, step: StepPlan, seqs: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
        time.sleep(self.delay)
        return self.inner(step, seqs)


class ScriptTokens:
    """A token source that answers every request with `script`, token by token."""

    def __init__(self, script: list[int]) -> None:
        self.script = script

    def __call__(self, seq: Any, position: int, new: Any) -> int:
        return self.script[(len(seq.output) + len(new)) % len(self.script)]
