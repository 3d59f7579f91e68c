"""qualify's client and bookkeeping: `Client` talks to the server, `Runner` sends each request,
predicts its cached_tokens (`RulePredictor`, `ShadowPredictor`) and judges every scenario."""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvreuse.deployment import Deployment, load_geometry
from kvreuse.qualify.predictor import RulePredictor, ShadowPredictor
from kvreuse.qualify.progress import ScenarioProgress

HITS = ("kvreuse:prefix_cache_hits_total", "vllm:prefix_cache_hits_total")
EVICTED = ("kvreuse:kv_blocks_evicted_total",)


class QualifyError(RuntimeError):
    """The server could not be qualified at all (no geometry, reset refused, bad answers)."""


class UsageError(QualifyError):
    """Nothing could be checked because of how qualify was called: a bad option, a model or
    geometry that does not load, or a --url nothing answers at (exit code 2, not 1)."""


@dataclass
class Row:
    scenario: str
    request: str
    prompt_tokens: int
    cached: int
    rules: int | None
    shadow: int
    answer_ok: bool | None = None
    failures: list[str] = field(default_factory=list)


@dataclass
class Scenario:
    name: str
    rows: list[Row] = field(default_factory=list)
    hits_delta: float = 0
    evicted: float = 0
    seconds: float = 0
    skipped: str | None = None
    failures: list[str] = field(default_factory=list)
    finished: bool = False  # ran to its end (an interrupted one is left out of the report)


class Client:
    def __init__(self, url: str, timeout: float = 600) -> None:
        self.http = httpx.Client(base_url=url.rstrip("/"), timeout=timeout)
        try:
            card = self.http.get("/v1/models").raise_for_status().json()["data"][0]
        except (httpx.InvalidURL, httpx.UnsupportedProtocol, httpx.ConnectError) as exc:
            self.http.close()
            raise UsageError(
                f"--url {url}: cannot connect ({exc}); is a server running there?"
            ) from None
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            self.http.close()
            raise QualifyError(f"{url}: cannot list the model ({exc})") from None
        self.model, self.max_model_len = card["id"], card.get("max_model_len")

    def close(self) -> None:
        self.http.close()

    def geometry(self) -> Deployment:
        r = self.http.get("/kvreuse/geometry")
        if r.status_code != 200:
            raise QualifyError("the server does not serve /kvreuse/geometry; pass --geometry")
        return load_geometry(r.text, "server geometry")

    def metric(self, names: tuple[str, ...]) -> float:
        text = self.http.get("/metrics").raise_for_status().text
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in names:
                return float(value)
        raise QualifyError(f"/metrics has none of {names}")

    def reset(self) -> None:
        r = self.http.post("/reset_prefix_cache")
        if r.status_code != 200:
            raise QualifyError(f"reset_prefix_cache answered {r.status_code}: {r.text[:200]}")

    def complete(self, prompt: list[int], max_tokens: int, stream: bool) -> tuple[int, list[int]]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "stream": stream,
        }
        if not stream:
            r = self.http.post("/v1/completions", json=body)
            if r.status_code != 200:
                raise QualifyError(f"completion answered {r.status_code}: {r.text[:300]}")
            data = r.json()
            return (
                data["usage"]["prompt_tokens_details"]["cached_tokens"],
                data["choices"][0]["token_ids"],
            )
        body["stream_options"] = {"include_usage": True}
        return self._stream(body)

    def _stream(self, body: dict[str, Any]) -> tuple[int, list[int]]:
        cached: int | None = None
        ids: list[int] = []
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise QualifyError(f"streamed completion answered {r.status_code}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise QualifyError(f"stream error: {chunk['error']}")
                for ch in chunk.get("choices", []):
                    ids = ch.get("token_ids", ids)
                if chunk.get("usage"):
                    cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached is None:
            raise QualifyError("a streamed response carried no usage block")
        return cached, ids


class Runner:
    def __init__(
        self,
        client: Client,
        dep: Deployment,
        seed: int,
        progress: ScenarioProgress | None = None,
    ) -> None:
        self.client, self.deployment = client, dep
        self.progress = progress or ScenarioProgress(enabled=False)
        self.rng = random.Random(seed)
        self.scenarios: list[Scenario] = []
        self.current: Scenario | None = None
        self.rules = RulePredictor(dep)
        self.shadow = ShadowPredictor(dep)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 256) for _ in range(n)]

    @contextlib.contextmanager
    def scenario(self, name: str) -> Iterator[Scenario]:
        sc = Scenario(name)
        self.scenarios.append(sc)
        self.progress.start(name)
        self.client.reset()
        self.rules, self.shadow = RulePredictor(self.deployment), ShadowPredictor(self.deployment)
        hits0, ev0, t0 = self.client.metric(HITS), self._evicted(), time.monotonic()
        self.current = sc
        try:
            yield sc
        finally:
            self.current = None
        sc.seconds = time.monotonic() - t0
        sc.hits_delta, sc.evicted = self.client.metric(HITS) - hits0, self._evicted() - ev0
        self._judge(sc)
        sc.finished = True
        bad = any(row.failures for row in sc.rows) or sc.failures
        self.progress.done(name, "skip" if sc.skipped else "FAIL" if bad else "pass")

    def _evicted(self) -> float:
        try:
            return self.client.metric(EVICTED)
        except QualifyError:
            return math.nan  # not reported: the rules column is then not judged

    def send(
        self,
        name: str,
        prompt: list[int],
        max_tokens: int,
        stream: bool = False,
        same_as: list[int] | None = None,
    ) -> list[int]:
        assert self.current is not None
        rule, junction = self.rules.predict(prompt)
        cached, out = self.client.complete(prompt, max_tokens, stream)
        shadow = self.shadow.run(prompt, out)
        self.rules.publish(prompt, out, rule, junction)
        row = Row(self.current.name, name, len(prompt), cached, rule, shadow)
        self.progress.sent()
        if same_as is not None:
            row.answer_ok = out == same_as
        self.current.rows.append(row)
        return out

    def _judge(self, sc: Scenario) -> None:
        rules_valid = sc.evicted == 0
        total = 0
        for row in sc.rows:
            total += row.cached
            where = f"{sc.name}/{row.request}"
            if row.cached != row.shadow:
                row.failures.append(f"{where}: cached_tokens {row.cached} != shadow {row.shadow}")
            if rules_valid and row.cached != row.rules:
                row.failures.append(f"{where}: cached_tokens {row.cached} != rules {row.rules}")
            if not rules_valid:
                row.rules = None
            if row.answer_ok is False:
                row.failures.append(f"{where}: warm answer differs from the cold answer")
        if total != sc.hits_delta:
            sc.failures.append(
                f"{sc.name}: counters: Σ cached_tokens {total} != Δ prefix_cache"
                f"_hits {sc.hits_delta:g}"
            )

    def failures(self) -> list[str]:
        out = []
        for sc in self.scenarios:
            out += [f for row in sc.rows for f in row.failures] + sc.failures
        return out
