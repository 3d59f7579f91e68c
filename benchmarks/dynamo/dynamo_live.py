"""A live `kvreuse serve` replica publishing KV events, NVIDIA Dynamo's standalone indexer
following it unmodified, and workloads driven through both, one request at a time.

Shared by tests/events/test_dynamo_indexer.py and benchmarks/dynamo_prediction.py. The indexer
runs in its own interpreter (`.venv-dynamo`, built by `benchmarks/dynamo/setup_venv.sh`) as
`python -m dynamo.indexer`; it is told about the replica with `POST /register` (its ZeroMQ
endpoint, its replay endpoint and the block size: the replica's hash unit, what `block_size`
says on the wire) and asked with `POST /query` (token ids) for the tokens each replica has
of a prompt: `instances[<id>].longest_matched`.

Before each query both sides are brought level: the replica's publisher has sent everything it
queued, and the indexer has applied as many events (its `/metrics` counter, whatever each
event's outcome) as the stream carried for the attention group.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvreuse.core import KVCacheManager
from kvreuse.deployment import Deployment
from kvreuse.events import Publisher, Subscriber, attention_group, decode_batch
from kvreuse.events.wire import BlockRemoved, BlockStored
from kvreuse.sched import ContentTokens, Scheduler, ScriptedEngine
from kvreuse.serve.app import create_app
from kvreuse.serve.backend import Backend
from kvreuse.serve.server import ServerThread
from kvreuse.sim.workload import VOCAB, parse_line, resolve_prompt
from kvreuse.tokenizer import ByteTokenizer

ROOT = Path(__file__).resolve().parents[2]
DYNAMO_PYTHON = ROOT / ".venv-dynamo" / "bin" / "python"
SETUP = "bash benchmarks/dynamo/setup_venv.sh"
MODEL = "kvreuse-replica"
INSTANCE_ID = 1


def loopback(endpoint: str) -> str:
    """The address a client on this machine dials for a socket bound to `tcp://*:port`."""
    return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DynamoIndexer:
    """`python -m dynamo.indexer` in its venv, on a free local port."""

    def __init__(self, python: Path = DYNAMO_PYTHON, log: Path | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        cmd = [str(python), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"]
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=30)
        deadline = time.monotonic() + 60
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"Dynamo's indexer did not start (exit {self.proc.returncode})")
            time.sleep(0.05)

    def _healthy(self) -> bool:
        try:
            return self.http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def register(self, endpoint: str, replay_endpoint: str | None, block_size: int) -> None:
        body = {
            "instance_id": INSTANCE_ID,
            "endpoint": endpoint,
            "model_name": MODEL,
            "block_size": block_size,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        r = self.http.post("/register", json=body)
        if r.status_code != 201:
            raise RuntimeError(f"/register answered {r.status_code}: {r.text}")

    def applied(self) -> int:
        """Events the indexer has applied to its tree, whatever their outcome (its Prometheus
        counter `dynamo_kvrouter_kv_cache_events_applied`, summed over types and statuses)."""
        total = 0.0
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith("dynamo_kvrouter_kv_cache_events_applied{"):
                total += float(line.rsplit(" ", 1)[1])
        return int(total)

    def longest_matched(self, tokens: list[int]) -> int:
        """Tokens of `tokens` the indexer says the replica holds (a multiple of its block)."""
        r = self.http.post("/query", json={"token_ids": tokens, "model_name": MODEL})
        if r.status_code == 404:  # no indexer for the model yet: nothing was ever stored
            return 0
        r.raise_for_status()
        return int(r.json()["instances"].get(str(INSTANCE_ID), {}).get("longest_matched", 0))

    def close(self) -> None:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def scripted_backend(dep: Deployment, saves: str = "up_to_end") -> Backend:
    """A `kvreuse serve` backend on `dep` without a model: content tokens (a warm answer equals
    the cold one), every save the core planned up to the end of a step reported by default
    (an engine that writes each planned state), prompt ids up to the workloads' vocabulary."""
    engine = ScriptedEngine(ContentTokens(), saves=saves)  # type: ignore[arg-type]
    sched = Scheduler(KVCacheManager(dep.cache), engine, dep.sched)
    return Backend(
        "kvreuse-scripted",
        ByteTokenizer(),
        sched,
        dep.max_model_len or 16384,
        dep,
        vocab_size=VOCAB,
    )


class LiveReplica:
    """`kvreuse serve` in this process (uvicorn on a free local port) publishing its KV events,
    and a kvreuse `Subscriber` following them (to know when a consumer has everything)."""

    def __init__(self, backend: Backend, mode: str) -> None:
        self.backend = backend
        self.geometry = backend.mgr.geo
        self.gid = attention_group(self.geometry).group_id
        self.pub = Publisher(
            self.geometry,
            endpoint="tcp://*:0",
            replay_endpoint="tcp://*:0",
            mode=mode,  # type: ignore[arg-type]
            buffer_steps=100_000,
        )
        self.endpoint = loopback(self.pub.endpoint)
        self.replay_endpoint = loopback(self.pub.replay_endpoint or "")
        self.server = ServerThread(create_app(backend, kv_events=self.pub))
        self.url = self.server.start()
        self.http = httpx.Client(base_url=self.url, timeout=120)
        self.sub = Subscriber()
        self.mirror = self.sub.add_replica(
            "replica", self.geometry, self.endpoint, replay_endpoint=self.replay_endpoint
        )

    def complete(self, tokens: list[int], max_tokens: int) -> tuple[int, list[int]]:
        """(cached tokens, generated token ids) of one completion."""
        body = {
            "model": self.backend.name,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        r = self.http.post("/v1/completions", json=body)
        r.raise_for_status()
        data = r.json()
        cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
        return int(cached), list(data["choices"][0]["token_ids"])

    def reset(self) -> None:
        """Drop every cached entry (`POST /reset_prefix_cache`; published as AllBlocksCleared)."""
        self.http.post("/reset_prefix_cache").raise_for_status()

    def sync(self, timeout: float = 30.0) -> None:
        """Wait until the subscriber has applied every batch the publisher has sent."""
        assert self.pub.flush(timeout), "the publisher did not send its queue in time"
        deadline = time.monotonic() + timeout
        stream = self.sub.stream("replica")
        while stream.next_seq < self.pub.next_seq:
            if time.monotonic() > deadline:
                raise TimeoutError(f"subscriber at {stream.next_seq} of {self.pub.next_seq}")
            if not self.sub.poll(50):
                self.sub.catch_up("replica")  # batches sent before the subscription arrived

    def published(self) -> set[int]:
        """The blocks of the published attention group, as the stream says (hash64 keys)."""
        return set(self.mirror.entries(self.gid))

    def main_group_events(self) -> int:
        """Events sent so far that an attention-only consumer applies: stores of full
        attention (or without a kind: legacy), removals in the attention group (or without a
        group), clears. Dynamo ignores the rest (other kinds, other groups)."""
        count = 0
        for _, payload in self.pub.buffer:
            for ev in decode_batch(payload).events:
                if isinstance(ev, BlockStored):
                    count += ev.kv_cache_spec_kind in (None, "full_attention")
                elif isinstance(ev, BlockRemoved):
                    count += ev.group_idx in (None, self.gid)
                else:
                    count += 1
        return count

    def close(self) -> None:
        self.http.close()
        self.sub.close()
        self.server.stop()  # the app closes the publisher after its step loop


def level(replica: LiveReplica, indexer: DynamoIndexer, timeout: float = 30.0) -> None:
    """Wait until the indexer has applied every event the replica has sent for the attention
    group (its tree may still differ from the replica's entries: that is what is measured)."""
    replica.sync(timeout)
    want = replica.main_group_events()
    deadline = time.monotonic() + timeout
    while (have := indexer.applied()) < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Dynamo's indexer applied {have} of {want} events")
        time.sleep(0.01)


def handshake(replica: LiveReplica, indexer: DynamoIndexer, attempts: int = 40) -> None:
    """Dynamo's listener subscribes in the background after `/register`, and a SUB socket
    misses what was sent before it joined (it replays a gap only once a later batch shows it).
    Send probe requests until the indexer holds what the stream published, then reset the
    cache, so that the workload starts from an empty cache on both sides."""
    u = replica.geometry.hash_unit
    for attempt in range(attempts):
        replica.complete([VOCAB - 1 - attempt] * (2 * u + 1), 1)
        try:
            level(replica, indexer, timeout=0.5)
        except TimeoutError:
            continue
        if replica.published():
            break
    else:
        raise RuntimeError(f"Dynamo's indexer saw none of {attempts} probe requests")
    replica.reset()
    level(replica, indexer)


@dataclass(frozen=True)
class Row:
    request_id: str
    prompt_tokens: int
    predicted: int  # the consumer's prediction, capped at the last unit boundary below the end
    cached: int  # what the replica reported


def drive(
    replica: LiveReplica, lines: list[dict[str, Any]], predict: Callable[[list[int]], int]
) -> Iterator[Row]:
    """Run a workload (the generators' JSON lines, in order, one request at a time); before
    each request, `predict(tokens)` is what the consumer says the replica holds."""
    u = replica.geometry.hash_unit
    history: dict[str, list[int]] = {}
    for lineno, obj in enumerate(lines, 1):
        req = parse_line(obj, lineno)
        tokens = resolve_prompt(req.prompt, history)
        top = (len(tokens) - 1) // u * u  # the last prompt token is always computed
        predicted = min(predict(tokens), top)
        cached, output = replica.complete(tokens, req.max_tokens)
        history[req.request_id] = tokens + output
        yield Row(req.request_id, len(tokens), predicted, cached // u * u)


@contextmanager
def dynamo_following(
    backend: Backend, mode: str, log: Path | None = None
) -> Iterator[tuple[LiveReplica, DynamoIndexer]]:
    """A live replica in `mode` and Dynamo's indexer registered on its stream."""
    replica = LiveReplica(backend, mode)
    try:
        indexer = DynamoIndexer(log=log)
        try:
            unit = replica.geometry.hash_unit
            indexer.register(replica.endpoint, replica.replay_endpoint, unit)
            handshake(replica, indexer)
            yield replica, indexer
        finally:
            indexer.close()
    finally:
        replica.close()


def dynamo_rows(
    replica: LiveReplica, indexer: DynamoIndexer, lines: list[dict[str, Any]]
) -> Iterator[Row]:
    """The workload, with Dynamo's `longest_matched` as the prediction before each request."""

    def predict(tokens: list[int]) -> int:
        level(replica, indexer)
        return indexer.longest_matched(tokens)

    return drive(replica, lines, predict)
