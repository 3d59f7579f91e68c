"""Chaos on a shared store: `kvreuse fleet` of three engine replicas of a real tiny hybrid
checkpoint (full attention and recurrent layers, saved with `save_model`) sharing one store in a
real Redis server, while the store is

    flipped      a byte of stored values inverted
    swapped      two stored values of the same size exchanged (each a valid frame, elsewhere)
    truncated    stored values cut short
    re-tagged    a payload byte edited and the frame's tag recomputed without the secret
    poisoned     an entry that decodes to nothing appended to its log
    paused       CLIENT PAUSE, then DEBUG SLEEP: every command waits past the clients' timeout
    squeezed     maxmemory with allkeys-lru: keys (slots, the log, the epoch) evicted
    killed       kill -9, then started empty; later kill -9 and started from an older dump
    fenced out   a replica SIGSTOPped while it holds the store's turn, past the turn's lease

and a client runs multi-turn sessions through the front, one request at a time, resending
earlier prompts so that their pages come back from the store.

Afterwards: every answer equals the cache-free greedy answer of its prompt (the same checkpoint
in this process, caching off); no replica process exited (every pid the one it started with,
no restart); every answer the front marked exact (`x-kvreuse-mirror-exact: true`) delivered its
prediction, and enough were marked exact, with store hits among them, for that to mean
something. The mutation check runs the swap with the replicas' identity check off (a
`sitecustomize` in their environment accepts a frame whatever block it names): answers then
differ from the cold ones, and the same check reports them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_front_util import command

from store_server import RedisProcess

for _name in ("fastapi", "uvicorn", "redis", "torch"):
    pytest.importorskip(
        _name, reason=f"the store chaos test needs {_name}: pip install -e '.[engine,server]'"
    )

MAX_TOKENS = 6
LEASE_S = 1.0
MAGIC = b"KVR2"  # a stored block's frame (kvreuse.engine.tiers)
TAG = 32

# the replicas' identity check turned off: the frame's own identity is taken for the one asked
NO_IDENTITY_CHECK = """
import struct
import kvreuse.engine.tiers as t
_decode = t.BytesTier.decode
def decode(self, raw, slot, ident):
    if raw is not None and raw[:4] == t.MAGIC and len(raw) >= 8:
        (n,) = struct.unpack_from(">I", raw, 4)
        ident = raw[8 : 8 + n]
    return _decode(self, raw, slot, ident)
t.BytesTier.decode = decode
"""


@dataclass
class Answer:
    prompt: list[int]
    status: int
    tokens: list[int] = field(default_factory=list)
    exact: bool = False
    predicted: int | None = None
    cached: int | None = None
    by_medium: dict[str, int] | None = None
    phase: str = ""


@dataclass
class Report:
    answers: list[Answer]
    cold: dict[tuple[int, ...], list[int]]
    pids_before: list[int | None]
    replicas_after: list[dict[str, Any]]
    faults: dict[str, int]  # per corruption: the replicas' faulty tier blocks it caused
    lines: list[str]  # what the fleet and its replicas printed

    def problems(self) -> list[str]:
        """What the run got wrong, one line each (nothing: it kept every promise)."""
        out = []
        for a in self.answers:
            if a.status != 200:
                out.append(f"{a.phase}: status {a.status}")
            elif a.tokens != self.cold[tuple(a.prompt)]:
                out.append(f"{a.phase}: {a.tokens} is not the cold answer "
                           f"{self.cold[tuple(a.prompt)]}")  # fmt: skip
            elif a.exact and a.predicted != a.cached:
                out.append(f"{a.phase}: marked exact, predicted {a.predicted}, got {a.cached}")
        for row in self.replicas_after:
            if row["restarts"] or row["state"] != "up":
                out.append(f"{row['name']}: {row['state']}, {row['restarts']} restarts")
        if [row["pid"] for row in self.replicas_after] != self.pids_before:
            out.append(f"pids {self.pids_before} became {[r['pid'] for r in self.replicas_after]}")
        return out


# ---------------------------------------------------------------------------- the store's keys
def stored_values(client: Any) -> dict[bytes, bytes]:
    """Every stored block's frame, by its key."""
    out = {}
    for key in client.scan_iter(_type="string", count=1000):
        value = client.get(key)
        if value is not None and value.startswith(MAGIC):
            out[key] = value
    return out


def flip(client: Any, rng: random.Random) -> None:
    for key, value in stored_values(client).items():
        i = rng.randrange(len(MAGIC) + 8, len(value) - TAG)
        client.set(key, value[:i] + bytes([value[i] ^ 0xFF]) + value[i + 1 :])


def truncate(client: Any, rng: random.Random) -> None:
    for key, value in stored_values(client).items():
        client.set(key, value[: rng.randrange(len(value))])


def retag(client: Any, rng: random.Random) -> None:
    """Edit the payload and tag the frame as a writer without the secret would."""
    for key, value in stored_values(client).items():
        body = bytearray(value[:-TAG])
        i = rng.randrange(len(body) // 2, len(body))
        body[i] ^= 0x01
        for secret in (b"", hashlib.sha256(bytes(body)).digest()):
            client.set(key, bytes(body) + hmac.digest(secret, bytes(body), "sha256"))


def swap(client: Any, rng: random.Random) -> None:
    """Exchange values of the same size: each a valid frame of another block."""
    by_size: dict[int, list[tuple[bytes, bytes]]] = {}
    for key, value in stored_values(client).items():
        by_size.setdefault(len(value), []).append((key, value))
    for items in by_size.values():
        values = [v for _, v in items]
        rng.shuffle(values)
        for (key, old), new in zip(items, [*values[1:], values[0]], strict=True):
            if new != old:
                client.set(key, new)


def poison(client: Any) -> None:
    """Append an entry that decodes to nothing, at the next number, as a writer would."""
    (log,) = client.scan_iter(match="kvreuse:*:log", _type="stream")
    seq_key = log[: -len(b"log")] + b"seq"
    seq = client.incr(seq_key)
    client.xadd(log, {"e": b"\xc1 not an entry"}, id=f"{seq}-0")


# ---------------------------------------------------------------------------- the fleet
@dataclass
class Sessions:
    """Multi-turn sessions over token ids; each turn quotes the whole history."""

    rng: random.Random
    histories: list[list[int]]
    sent: list[list[int]] = field(default_factory=list)

    def next_prompt(self) -> list[int]:
        rng = self.rng
        if self.sent and rng.random() < 0.35:  # a resend: its pages may be in the store only
            return rng.choice(self.sent)
        i = rng.randrange(len(self.histories))
        if len(self.histories[i]) > 1200:
            self.histories[i] = []
        self.histories[i] = self.histories[i] + [rng.randrange(256) for _ in range(60)]
        return self.histories[i]


def ask(client: httpx.Client, url: str, prompt: list[int], phase: str) -> Answer:
    body = {"model": "tiny-ckpt", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    try:
        resp = client.post(f"{url}/v1/completions", json=body)
    except httpx.HTTPError:
        return Answer(prompt, 0, phase=phase)
    answer = Answer(prompt, resp.status_code, phase=phase)
    if resp.status_code == 200:
        data = resp.json()
        details = data["usage"]["prompt_tokens_details"]
        answer.tokens = data["choices"][0]["token_ids"]
        answer.cached = details["cached_tokens"]
        answer.by_medium = details.get("cached_tokens_by_medium")
        predicted = resp.headers.get("x-kvreuse-predicted-cached-tokens")
        answer.predicted = None if predicted is None else int(predicted)
        answer.exact = resp.headers.get("x-kvreuse-mirror-exact") == "true"
    return answer


@contextmanager
def fleet(model: Path, store_url: str, env: dict[str, str], lines: list[str]) -> Iterator[str]:
    args = ["fleet", "--replicas", "3", "--port", "0", "--model", str(model)]
    args += ["--num-blocks", "16", "--policy", "exact", "--health-interval", "0.3"]
    args += ["--", "--store-capacity", "40K", "--store-url", store_url, "--store-shared"]
    args += ["--store-admission", "write-through", "--store-lease", str(LEASE_S)]
    with command(args, "kvreuse fleet:", env=env, seen=lines) as url:
        yield url


def replicas(url: str) -> list[dict[str, Any]]:
    return list(httpx.get(f"{url}/fleet/replicas", timeout=10).json()["replicas"])


def faulty_blocks(rows: list[dict[str, Any]]) -> int:
    """The replicas' tier slots whose bytes failed so far."""
    total = 0
    for row in rows:
        text = httpx.get(f"{row['url']}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith("kvreuse:kv_tier_faulty_blocks_total{"):
                total += int(float(line.rsplit(" ", 1)[1]))
    return total


def fence_out(url: str, store: Any, client: httpx.Client, sessions: Sessions) -> list[Answer]:
    """SIGSTOP replica 0 while it holds the store's turn (it alone is stepping: a request sent
    to it directly), keep it stopped past the lease while replica 1 takes turns, then
    SIGCONT it: its turn's writes are fenced out. Both requests' answers are returned."""
    rows = replicas(url)
    pid, url0, url1 = rows[0]["pid"], rows[0]["url"], rows[1]["url"]
    prompt = sessions.next_prompt()
    out: list[Answer] = []
    body_thread = threading.Thread(
        target=lambda: out.append(ask(client, url0, prompt, "fenced-out (stopped)")),
        daemon=True,
    )
    body_thread.start()
    stopped = False
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and body_thread.is_alive():
        os.kill(pid, signal.SIGSTOP)
        if store.keys("kvreuse:*:turn"):  # the only replica stepping holds it
            stopped = True
            break
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.001)
    assert stopped, "replica 0 was never caught holding the store's turn"
    try:
        time.sleep(LEASE_S + 0.5)  # its lease runs out
        out.append(ask(client, url1, sessions.next_prompt(), "fenced-out (other replica)"))
    finally:
        os.kill(pid, signal.SIGCONT)
    body_thread.join(60)
    assert len(out) == 2
    return out


# ---------------------------------------------------------------------------- the run
CORRUPTIONS = {"flip": flip, "swap": swap, "truncate": truncate, "retag": retag}


def run_chaos(tmp: Path, plan: list[str], seed: int, env: dict[str, str]) -> Report:
    import redis

    from kvreuse.engine import LLM, SamplingParams
    from kvreuse.engine.checkpoint import save_model

    rng = random.Random(seed)
    model = save_model(LLM(geometry="tiny-hybrid-dcp4", seed=11), tmp / "tiny-ckpt")
    server = RedisProcess(tmp / "redis")
    server.start()
    answers: list[Answer] = []
    faults: dict[str, int] = {}
    lines: list[str] = []
    sessions = Sessions(rng, [[] for _ in range(4)])
    dump = tmp / "older.rdb"
    try:
        store = redis.Redis(port=server.port, socket_timeout=10)
        with fleet(model, server.url, env, lines) as url, httpx.Client(timeout=120) as client:
            rows = replicas(url)
            pids = [row["pid"] for row in rows]

            def traffic(phase: str, n: int = 4) -> None:
                for _ in range(n):
                    prompt = sessions.next_prompt()
                    answers.append(ask(client, url, prompt, phase))
                    if answers[-1].status == 200:
                        sessions.sent.append(prompt)

            def probe(phase: str) -> None:
                """Earlier prompts sent to every replica: those that do not hold them on the
                device load them from the store."""
                for prompt in rng.sample(sessions.sent, min(3, len(sessions.sent))):
                    for row in rows:
                        answers.append(ask(client, row["url"], prompt, f"{phase} (direct)"))

            traffic("warm-up", 8)
            for step in plan:
                if step in CORRUPTIONS:
                    before = faulty_blocks(rows)
                    CORRUPTIONS[step](store, rng)
                    probe(step)
                    faults[step] = faulty_blocks(rows) - before
                else:
                    act(step, store, server, dump, lambda n, s=step: traffic(s, n))
                if step == "fence-out":
                    answers.extend(fence_out(url, store, client, sessions))
                traffic(step)
            after = replicas(url)
        cold_llm = LLM(model, enable_caching=False)
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        cold: dict[tuple[int, ...], list[int]] = {}
        for a in answers:
            if tuple(a.prompt) not in cold:
                cold[tuple(a.prompt)] = cold_llm.generate([a.prompt], sp)[0].token_ids
    finally:
        server.kill()
    return Report(answers, cold, pids, after, faults, lines)


def act(
    step: str, store: Any, server: RedisProcess, dump: Path, traffic: Callable[[int], None]
) -> None:
    """One fault of the store itself (`traffic(n)`: n requests, while it lasts)."""
    import redis

    if step == "poison":
        poison(store)
    elif step == "save":
        store.save()
        shutil.copy(server.folder / "dump.rdb", dump)
    elif step == "pause":
        store.execute_command("CLIENT", "PAUSE", 3000, "ALL")
    elif step == "sleep":
        sleeper = redis.Redis(port=server.port)
        threading.Thread(target=sleeper.execute_command, args=("DEBUG", "SLEEP", 3),
                         daemon=True).start()  # fmt: skip
        time.sleep(0.1)
    elif step == "squeeze":
        used = int(store.info("memory")["used_memory"])
        store.config_set("maxmemory-policy", "allkeys-lru")
        store.config_set("maxmemory", used + 256 * 1024)
        traffic(6)
        store.config_set("maxmemory", 0)
    elif step == "restart-empty":
        server.kill()
        traffic(2)
        server.start()
    elif step == "restart-older":
        server.kill()
        server.start(dump=dump)
    elif step != "fence-out":
        raise AssertionError(f"unknown step {step}")


PLAN = ["flip", "swap", "truncate", "retag", "save", "poison", "pause", "sleep", "squeeze",
        "restart-empty", "restart-older", "fence-out"]  # fmt: skip


def test_no_store_fault_gives_a_wrong_token_a_dead_replica_or_a_false_exact(
    tmp_path: Path,
) -> None:
    report = run_chaos(tmp_path, PLAN, seed=3, env=dict(os.environ))
    assert report.problems() == []
    # the run did what it says: each corruption was read and refused, a turn was fenced out
    assert all(report.faults[c] > 0 for c in CORRUPTIONS), report.faults
    assert any("fence was taken" in line for line in report.lines)
    # and the exactness check is not vacuous
    exact = [a for a in report.answers if a.exact]
    from_store = sum((a.by_medium or {}).get("STORE", 0) for a in exact)
    assert len(exact) >= 15 and from_store > 0, (len(exact), from_store)


def test_with_the_identity_check_off_the_chaos_test_fails(tmp_path: Path) -> None:
    patch = tmp_path / "patch"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(NO_IDENTITY_CHECK)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(patch), *filter(None, [env.get("PYTHONPATH")])])
    report = run_chaos(tmp_path, ["swap", "swap"], seed=3, env=env)
    wrong = [p for p in report.problems() if "is not the cold answer" in p]
    assert wrong, "swapped blocks were loaded unnoticed, yet every answer was right"
