"""A real consumer, unchanged: NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`
from ai-dynamo-runtime, in `.venv-dynamo`) follows a live `kvreuse serve` replica's KV events.

On attention-only geometries (DCP-sharded pages included, whose physical page is 4 hash units),
for every request of an agent and a shared-prefix workload, the indexer's `longest_matched`
(capped at the last unit boundary before the prompt's end, as the replica always computes the
last token) equals the cached tokens the replica then reports. On a DCP4 hybrid that keeps a
state at every unit, `routable` mode keeps it exact under eviction, where `groups` mode shows
it too little. The shared pieces live in benchmarks/dynamo/dynamo_live.py; the errors on other
hybrids are measured by benchmarks/dynamo_prediction.py.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

for _name in ("fastapi", "uvicorn", "httpx"):
    pytest.importorskip(_name, reason="this test runs a server: pip install -e '.[server]'")

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS / "dynamo"))  # not benchmarks/ itself: its ray/ would shadow ray

from dynamo_live import (  # noqa: E402
    DYNAMO_PYTHON,
    SETUP,
    DynamoIndexer,
    dynamo_following,
    dynamo_rows,
    scripted_backend,
)

from kvreuse.core import CacheConfig, GroupSpec, KVCacheManager, Request  # noqa: E402
from kvreuse.deployment import resolve  # noqa: E402
from kvreuse.events import Converter, Publisher  # noqa: E402
from kvreuse.events.wire import EventBatch, encode_batch  # noqa: E402
from kvreuse.sim.generators import agent, shared_prefix  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "dynamo_prediction", BENCHMARKS / "dynamo_prediction.py"
)
assert _spec is not None and _spec.loader is not None
prediction = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prediction)

pytestmark = pytest.mark.needs(DYNAMO_PYTHON.exists(), "Dynamo's indexer venv", SETUP)


def workload() -> list[dict[str, object]]:
    return agent(
        sessions=2, turns=6, user_len=40, tool_len=20, max_tokens=4, seed=1
    ) + shared_prefix(prefix_len=100, suffix_len=30, requests=8, max_tokens=4, seed=2)


@pytest.mark.parametrize(
    ("geometry", "mode"),
    [
        ("tiny-attention", "groups"),
        ("tiny-attention", "legacy"),
        ("tiny-attention", "routable"),
        ("tiny-attention-dcp4", "groups"),  # pages of 64 tokens, 16 on the wire
    ],
)
def test_dynamo_predicts_every_cached_token_on_attention_only(geometry: str, mode: str) -> None:
    with dynamo_following(scripted_backend(resolve(geometry)), mode) as (replica, indexer):
        rows = list(dynamo_rows(replica, indexer, workload()))
    assert [(r.request_id, r.predicted) for r in rows] == [(r.request_id, r.cached) for r in rows]
    assert sum(r.cached for r in rows) > 0.5 * sum(r.prompt_tokens for r in rows)


def test_routable_keeps_dynamo_exact_on_a_dense_hybrid_that_evicts() -> None:
    """tiny-hybrid-dcp4 (pages of 16 units, a state at every unit) in a pool that evicts:
    `groups` publishes the index, whose holes (units keyed on a page since evicted, their
    tokens still held by a copy) stop Dynamo's contiguous match short; `routable` publishes
    the path through them, and Dynamo is exact."""
    dep = resolve("tiny-hybrid-dcp4")
    dep = replace(dep, cache=replace(dep.cache, num_blocks=55, recurrent_retention="dense"))
    lines = agent(
        sessions=2, turns=4, user_len=197, tool_len=131, max_tokens=8, seed=5
    ) + shared_prefix(prefix_len=391, suffix_len=129, requests=5, max_tokens=8, seed=6)
    errors = {}
    for mode in ("groups", "routable"):
        with dynamo_following(scripted_backend(dep), mode) as (replica, indexer):
            errors[mode] = [r.predicted - r.cached for r in dynamo_rows(replica, indexer, lines)]
    assert errors["routable"] == [0] * len(lines)
    assert min(errors["groups"]) < 0


@pytest.mark.parametrize("evicts", [False, True])
def test_routable_is_never_worse_than_groups_on_a_sparse_hybrid(evicts: bool) -> None:
    """hybrid-dcp4 with sparse states (D40), on benchmarks/dynamo_prediction.py's workload:
    without eviction both modes publish the same chain and err alike (a request diverging
    between two checkpoints); once states and pages are evicted, `routable` errs strictly less."""
    dep = resolve("hybrid-dcp4")
    if evicts:
        dep = replace(dep, cache=replace(dep.cache, num_blocks=prediction.tight_pool(dep)))
    lines = prediction.workload(dep.cache.geometry.hash_unit, quick=False)
    total = {}
    for mode in ("groups", "routable"):
        with dynamo_following(scripted_backend(dep), mode) as (replica, indexer):
            rows = list(dynamo_rows(replica, indexer, lines))
        total[mode] = sum(abs(r.predicted - r.cached) for r in rows)
    assert total["routable"] <= total["groups"]
    assert (total["routable"] < total["groups"]) == evicts


def test_dynamo_repairs_a_lost_batch_through_kvreuse_replay() -> None:
    """A batch kept in the replay buffer but never sent on the stream: Dynamo sees the gap at
    the next batch and asks the replay socket, whose answer must be vLLM's to the byte (it
    ignored an answer whose end marker carried anything in its last frame)."""
    cfg = CacheConfig(num_blocks=256, groups=[GroupSpec(kind="full", block_size=16)])
    mgr = KVCacheManager(cfg)
    converter = Converter(cfg.geometry)

    def run(rid: str, tokens: list[int]) -> list[object]:
        mgr.add_request(Request(rid, tokens))
        res = mgr.lookup(rid)
        assert mgr.allocate(rid, len(tokens) - res.hit, lookup=res) is not None
        step = mgr.seal_step()
        mgr.commit(step.step_id, {rid: (len(tokens), [5])})
        mgr.finish(rid)
        return list(mgr.take_events())

    pub = Publisher(cfg.geometry, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    indexer = DynamoIndexer()
    try:
        port, replay = (e.rsplit(":", 1)[1] for e in (pub.endpoint, pub.replay_endpoint or ""))
        indexer.register(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", 16)
        for i in range(100):  # until Dynamo's subscription is up
            pub.publish(run(f"probe{i}", [1000 + i] * 33))  # type: ignore[arg-type]
            assert pub.flush()
            time.sleep(0.1)
            if indexer.applied() > 0:
                break
        base = indexer.applied()
        assert base > 0
        lost = converter.convert(run("lost", [7] * 33))  # type: ignore[arg-type]
        pub.buffer.append((pub.next_seq, encode_batch(EventBatch(time.time(), lost, 0))))
        pub._next_seq += 1  # buffered, never sent: only the replay has it
        pub.publish(run("after", [8] * 33))  # type: ignore[arg-type]
        assert pub.flush()
        deadline = time.monotonic() + 20
        while indexer.applied() < base + 2:
            assert time.monotonic() < deadline, f"applied {indexer.applied() - base} of 2"
            time.sleep(0.05)
    finally:
        indexer.close()
        pub.close()
