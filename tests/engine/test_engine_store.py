"""Replicas sharing one store in a real Redis server: a session started on one replica, its
blocks evicted to the store, goes on on another replica and reuses its history from the store,
with the same tokens and logits as a cold run; the router that moves it predicts, tier by tier,
what that replica loads; replicas of another model keep apart."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvreuse.core import Admission, SharedTier, TierSpec
from kvreuse.deployment import preset
from kvreuse.engine import LLM, SamplingParams
from kvreuse.engine.store import RedisBytes, StoreUnavailable
from kvreuse.engine.tiers import BytesTier, HostTier
from kvreuse.events import Converter, StoreMirror
from kvreuse.fleet.routing.router import Router
from kvreuse.serve.store_view import decode, decode_state
from store_server import redis_server

GEOMETRY = "tiny-hybrid-dcp4"
POOL = 12
SP = SamplingParams(temperature=0.0, max_tokens=6)
RNG = random.Random(5)
HISTORY = [RNG.randrange(256) for _ in range(150)]
FLOODS = [[RNG.randrange(256) for _ in range(150)] for _ in range(3)]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as u:
        yield u


def replicas(
    url: str, n: int, seed: int = 0, admission: Admission = Admission.ON_EVICTION
) -> tuple[list[LLM], SharedTier]:
    """`n` LLMs of one model, each with a host tier of its own that keeps nothing, over one
    store tier in the server."""
    store = SharedTier(TierSpec("store", 400, default=admission), preset(GEOMETRY).cache)
    out = []
    for _ in range(n):
        host = TierSpec("host", 400, default=Admission.NEVER)
        tiers = [(host, HostTier()), (store, BytesTier(RedisBytes(url)))]
        out.append(LLM(geometry=GEOMETRY, num_blocks=POOL, tiers=tiers, seed=seed))
    return out, store


def run(llm: LLM, prompt: list[int]) -> tuple[list[int], torch.Tensor, int]:
    llm.runner.record_logits = True
    res = llm.generate([prompt], SP)[0]
    logits = torch.stack(llm.runner.logits_log[res.request_id][: len(res.token_ids)])
    llm.mgr.check_invariants()
    return res.token_ids, logits, res.cached_tokens


def test_a_session_moved_to_another_replica_reuses_its_history_from_the_store(url: str) -> None:
    (a, b, c), store = replicas(url, 3)
    run(a, HISTORY)
    for flood in FLOODS:  # a's pool evicts the session's pages and states to the store
        run(a, flood)
    assert len(store) > 0
    turn = [*HISTORY, 7, 8, 9]
    cold_tokens, cold_logits, _ = run(LLM(geometry=GEOMETRY, enable_caching=False), turn)
    before = [sum(row) for row in b.mgr.tiers.num_loaded]
    tokens, logits, cached = run(b, turn)  # the next turn lands on b
    loaded = [sum(row) - x for row, x in zip(b.mgr.tiers.num_loaded, before, strict=True)]
    assert cached == b.mgr.replay_point(len(HISTORY)) > 0
    assert loaded[0] == 0 and loaded[1] > 0 and b.mgr.tiers.hit_tokens == [0, cached]
    assert tokens == cold_tokens
    assert torch.allclose(logits, cold_logits, atol=1e-4)
    assert run(c, [RNG.randrange(256) for _ in range(40)])[2] == 0  # c shares no prompt yet


def test_a_write_through_store_serves_the_next_turn_on_another_replica_at_once(url: str) -> None:
    """With the store written through, a session's blocks are in the store as soon as they
    are computed: its next turn on another replica loads the whole history, though the first
    replica evicted nothing, with the same tokens and logits as a cold run."""
    (a, b), store = replicas(url, 2, admission=Admission.WRITE_THROUGH)
    run(a, HISTORY)
    assert a.mgr.metrics()["kv_blocks_evicted_total"] == 0 and len(store) > 0
    turn = [*HISTORY, 7, 8, 9]
    cold_tokens, cold_logits, _ = run(LLM(geometry=GEOMETRY, enable_caching=False), turn)
    tokens, logits, cached = run(b, turn)
    assert cached == b.mgr.replay_point(len(HISTORY)) > 0
    assert b.mgr.tiers.hit_tokens == [0, cached]  # all of it from the store
    assert tokens == cold_tokens
    assert torch.allclose(logits, cold_logits, atol=1e-4)


def test_the_router_moves_a_session_and_predicts_each_tier_it_loads_from(url: str) -> None:
    """3 replicas with a small host tier each over one store, followed by a router through
    their KV events and the store's: with the session's replica busy, the next turn goes to
    another one, and the router's predicted hit, host tokens and store tokens are what that
    replica delivers, with the tokens of a cold run."""
    dep = preset(GEOMETRY)
    dep = replace(dep, cache=replace(dep.cache, enable_events=True))
    store = SharedTier(TierSpec("store", 400), dep.cache, enable_events=True)
    llms = []
    for _ in range(3):
        tiers = [
            (TierSpec("host", 2, medium="CPU"), HostTier()),  # it keeps the floods' last blocks
            (store, BytesTier(RedisBytes(url))),
        ]
        llms.append(LLM(geometry=dep, num_blocks=POOL, tiers=tiers))
    router = Router(dep.cache, "exact")
    store_mirror = StoreMirror(dep.cache.geometry, "STORE")
    for i in range(3):
        router.add_replica(f"r{i}", tiers=["CPU", "STORE"], shared=[store_mirror])

    def publish() -> None:
        for i, llm in enumerate(llms):
            router.apply(i, Converter(llm.mgr.geo).convert(llm.mgr.take_events()))
        store_mirror.apply(Converter(dep.cache.geometry).convert(store.take_events()))

    run(llms[0], HISTORY)
    for flood in FLOODS:  # the session's pages and states go down to the store
        run(llms[0], flood)
    publish()
    turn = [*HISTORY, 7, 8, 9]
    router.set_load(0, 10**7, 50)  # r0 is busy: the turn moves
    decision = router.route(router.query(turn, request_id="turn-2"))
    assert decision.index != 0
    cold_tokens, _, _ = run(LLM(geometry=GEOMETRY, enable_caching=False), turn)
    llm = llms[decision.index]
    tokens, _, cached = run(llm, turn)
    delivered = llm.mgr.request_stats("llm-0").tier_tokens  # its first request
    assert tokens == cold_tokens
    assert cached > 0 and decision.predicted_cached == cached
    assert delivered == (0, cached) and decision.predicted_tiers == delivered  # all from the store


def test_replicas_of_another_model_never_read_the_stores_bytes(url: str) -> None:
    (a,), _ = replicas(url, 1, seed=0)
    (other,), _ = replicas(url, 1, seed=1)  # the same layout, other weights
    ns = [llm.runner.tiers[1].prefix for llm in (a, other)]
    assert ns[0] != ns[1]
    run(a, HISTORY)
    for flood in FLOODS:
        run(a, flood)
    keys = list(RedisBytes(url))
    assert any(k.startswith(ns[0]) for k in keys)
    assert not any(k.startswith(ns[1]) for k in keys)


def test_an_unreachable_store_says_where_it_looked() -> None:
    with pytest.raises(
        StoreUnavailable, match=r"cannot reach the store at redis://127\.0\.0\.1:1/0"
    ):
        RedisBytes("redis://127.0.0.1:1/0", timeout_s=0.5)


def test_the_server_is_stopped_by_its_pid(tmp_path: Path) -> None:
    import redis

    with redis_server(tmp_path) as u:
        RedisBytes(u)["probe"] = b"x"
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(u, socket_connect_timeout=0.5).ping()


def test_serve_keeps_its_store_tier_in_the_server(url: str) -> None:
    """`kvreuse serve --store-capacity --store-url`: the resend of an evicted prompt loads its
    prefix from Redis, answers as the cold request did, and /metrics counts the store's hit and
    the bytes that came back; at shutdown the server deletes the store tier it alone used."""
    import httpx

    from kvreuse.serve import default_backend
    from kvreuse.serve.app import create_app
    from kvreuse.serve.backend import TierOptions
    from kvreuse.serve.server import ServerThread

    backend = default_backend(num_blocks=16, tiers=TierOptions(store_tokens=20_000, store_url=url))
    body = {"model": backend.name, "max_tokens": 4, "temperature": 0}

    def send(base: str, prompt: str) -> tuple[str, int]:
        r = httpx.post(base + "/v1/completions", json={**body, "prompt": prompt}).json()
        return r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

    with ServerThread(create_app(backend)) as base:
        prompt = "The store keeps what the device evicts. " * 7
        cold, _ = send(base, prompt)
        for i in range(6):
            send(base, f"{i} flood " * 40)
        warm, hit = send(base, prompt)
        text = httpx.get(base + "/metrics").text
        held = RedisBytes(url).client.keys("kvreuse:*:own-*")
    store = backend.mgr.metrics()["tiers"]["store"]
    assert warm == cold and hit > 0 and store["hit_tokens"] > 0
    hits = f'kvreuse:kv_tier_hits_total{{medium="STORE",tier="store"}} {store["hit_tokens"]:.1f}'
    assert hits in text
    assert 'kvreuse:kv_offload_total_bytes_total{transfer_type="STORE_to_GPU"}' in text
    assert len(held) >= store["held_blocks"] > 0  # the slots' bytes were in the server
    # and a clean shutdown took them away: a restart does not leave a namespace behind
    assert RedisBytes(url).client.keys("kvreuse:*:own-*") == []


def _complete(base: str, model: str, prompt: str) -> tuple[str, int]:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    r = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
    return r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_servers_share_one_store_through_the_server(url: str) -> None:
    """Two servers (`--store-shared`), each with its own copy of the store's index: what one
    writes through is a hit on the other, their copies stay equal slot for slot, and each
    answers as a cold request does."""
    from kvreuse.serve import fake_backend
    from kvreuse.serve.app import create_app
    from kvreuse.serve.backend import TierOptions
    from kvreuse.serve.server import ServerThread

    tiers = TierOptions(
        store_tokens=20_000, store_url=url, store_admission="write-through", store_shared=True
    )
    a, b = (fake_backend(num_blocks=40, tiers=tiers) for _ in range(2))
    cold = fake_backend(num_blocks=40)
    with (
        ServerThread(create_app(a)) as ua,
        ServerThread(create_app(b)) as ub,
        ServerThread(create_app(cold)) as uc,
        ThreadPoolExecutor(2) as pool,
    ):
        prompt = "a document both servers read " * 10
        first, hit_a = _complete(ua, "kvreuse-fake", prompt)
        again, hit_b = _complete(ub, "kvreuse-fake", prompt)  # b never saw it
        alone, _ = _complete(uc, "kvreuse-fake", prompt)
        for i in range(6):  # both at once: their steps take turns over the store
            text = f"turn {i} " * 30
            both = list(pool.map(_complete, (ua, ub), ["kvreuse-fake"] * 2, [text] * 2))
            assert both[0][0] == both[1][0] == _complete(uc, "kvreuse-fake", text)[0]
        _complete(ub, "kvreuse-fake", "the last turn is b's " * 3)
    assert hit_a == 0 and hit_b > 0 and first == again == alone
    assert b.mgr.metrics()["tiers"]["store"]["hit_tokens"] >= hit_b > 0
    # b took the last turn: a copy rebuilt from the snapshot and the log is b's, slot for slot
    sb = b.mgr.tiers.shared[0]
    assert isinstance(sb, SharedTier) and len(sb) > 0
    rebuilt = SharedTier(sb.spec, sb.config)
    keys = b.scheduler.turn.__self__.keys
    client = RedisBytes(url).client
    _, snap_seq, state = decode_state(client.get(keys.snap))
    rebuilt.import_state(state)
    for _, fields in client.xrange(keys.log, min=f"{snap_seq + 1}-0", max="+"):
        rebuilt.replay(decode(fields[b"e"]))
    assert {s: e.keys for s, e in rebuilt.slots.items()} == {s: e.keys for s, e in sb.slots.items()}
    assert list(rebuilt.order) == list(sb.order) and rebuilt._free == sb._free


def test_two_server_processes_share_the_store(url: str, tmp_path: Path) -> None:
    """`kvreuse serve --store-shared` twice, as separate processes on the tiny model: a prompt
    computed on one is loaded from the store by the other, with the cold answer's tokens."""
    import re
    import subprocess
    import sys

    args = ["--num-blocks", "16", "--store-capacity", "20K", "--store-url", url]
    args += ["--store-admission", "write-through", "--store-shared", "--port", "0"]
    procs, urls = [], []
    try:
        for i in range(2):
            log = (tmp_path / f"serve{i}.log").open("w+")
            procs.append((subprocess.Popen(
                [sys.executable, "-m", "kvreuse", "serve", *args],
                stdout=log, stderr=subprocess.STDOUT, text=True,
            ), log))  # fmt: skip
        for proc, log in procs:
            for _ in range(1200):
                found = re.search(
                    r" on (http://\S+)/v1", (tmp_path / Path(log.name).name).read_text()
                )
                if found or proc.poll() is not None:
                    break
                time.sleep(0.1)
            assert found, (tmp_path / Path(log.name).name).read_text()
            urls.append(found.group(1))
        import httpx

        model = httpx.get(urls[0] + "/v1/models").json()["data"][0]["id"]
        prompt = "The store is shared by two processes. " * 6
        cold, hit_cold = _complete(urls[0], model, prompt)
        warm, hit_warm = _complete(urls[1], model, prompt)
        metrics = httpx.get(urls[1] + "/metrics").text
    finally:
        for proc, log in procs:
            proc.terminate()
            proc.wait(timeout=30)
            log.close()
    assert hit_cold == 0 and hit_warm > 0 and warm == cold
    assert 'kvreuse:kv_offload_total_bytes_total{transfer_type="STORE_to_GPU"}' in metrics
