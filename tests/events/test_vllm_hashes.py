"""hash_algo "sha256_cbor" against vLLM 0.33.0 itself (vllm_hash_driver.py, run by the venv
that benchmarks/vllm/setup_venv.sh builds): vLLM's `KVCacheManager` and kvreuse's, on the same
traffic (LoRA, cache salt and multimodal items included), announce the same blocks under the same
hashes, parents and extra keys, in kvreuse's groups and routable modes; and a router that only
recomputes vLLM's hashes from tokens predicts every hit delivered, on either replica and on a
fleet of one of each.

The router here is written from vLLM's documented hashing with cbor2 and hashlib, not with
kvreuse's code: it is what an external indexer (llm-d's) does.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvreuse.core import CacheConfig, GroupSpec, KVCacheManager, MultiModalItem, Request
from kvreuse.events.convert import Converter
from kvreuse.events.routable import RoutableFilter
from kvreuse.events.wire import EventBatch, decode_batch, encode_batch

cbor2 = pytest.importorskip("cbor2")

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm-anchor" / "bin" / "python"
DRIVER = Path(__file__).with_name("vllm_hash_driver.py")
BLOCK, NUM_BLOCKS, SEED = 4, 40, "4242"  # a small pool, so that blocks are also evicted

pytestmark = pytest.mark.needs(
    VLLM_PYTHON.exists(), "vLLM 0.33.0's venv", "bash benchmarks/vllm/setup_venv.sh"
)

Spec = dict[str, Any]


def traffic(seed: int, n: int = 60) -> list[Spec]:
    """Conversations that grow, resend and share prefixes; some under a LoRA, some salted, some
    with an image placeholder."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 200_000) for _ in range(13)]
    out: list[Spec] = []
    for i in range(n):
        if out and rng.random() < 0.4:
            spec = dict(rng.choice(out))
            spec["tokens"] = spec["tokens"] + [rng.randrange(1, 70_000) for _ in range(5)]
        else:
            cut = rng.randrange(0, len(system) + 1)
            tail = [rng.randrange(1, 70_000) for _ in range(rng.randrange(1, 14))]
            spec = {"tokens": system[:cut] + tail, "lora": None, "salt": None, "mm": []}
            r = rng.random()
            if r < 0.2:
                spec["lora"] = ["fr", "/ad/fr-v1"]
            elif r < 0.35:
                spec["salt"] = rng.choice(["tenant-a", "tenant-b"])
            elif r < 0.55:
                spec["mm"] = [[f"img-{rng.randrange(3)}", rng.randrange(0, 8), rng.randrange(1, 9)]]
        spec["id"] = f"r{i}"
        out.append(spec)
    return out


# ------------------------------------------------------------------------------------ replicas
class VllmReplica:
    """vLLM's KVCacheManager in its own interpreter, one request per line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.none_hash = self._ask({"block_size": BLOCK, "num_blocks": NUM_BLOCKS})["none_hash"]

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "vLLM's driver ended early (see its stderr above)"
        return json.loads(line)

    def run(self, spec: Spec) -> tuple[int, list[dict[str, Any]]]:
        answer = self._ask(spec)
        return answer["hit"], answer["events"]


@contextmanager
def vllm_replica(seed: str | None = SEED) -> Iterator[VllmReplica]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    proc = subprocess.Popen(
        [str(VLLM_PYTHON), str(DRIVER)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        yield VllmReplica(proc)
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.wait(timeout=60)
        proc.stdout.close()


class KvreuseReplica:
    """kvreuse's manager in sha256_cbor mode, its events through one event mode and msgpack."""

    def __init__(self, mode: str, seed: str | None = SEED) -> None:
        cfg = CacheConfig(
            num_blocks=NUM_BLOCKS,
            hash_algo="sha256_cbor",
            hash_seed=seed,
            groups=[GroupSpec(kind="full", block_size=BLOCK)],
        )
        self.mgr = KVCacheManager(cfg)
        self.conv = RoutableFilter(cfg.geometry) if mode == "routable" else Converter(cfg.geometry)

    def run(self, spec: Spec) -> tuple[int, list[dict[str, Any]]]:
        mgr, rid, tokens = self.mgr, spec["id"], spec["tokens"]
        mm = [MultiModalItem(i, o, n) for i, o, n in spec["mm"]]
        lora = tuple(spec["lora"]) if spec["lora"] else None
        mgr.add_request(Request(rid, tokens, lora=lora, mm_items=mm, cache_salt=spec["salt"]))
        res = mgr.lookup(rid)
        assert mgr.allocate(rid, len(tokens) - res.hit, lookup=res) is not None
        step = mgr.seal_step()
        mgr.commit(step.step_id, {rid: (len(tokens), [5])})  # the sampled token: not cached
        mgr.finish(rid)
        wire = self.conv.convert(mgr.take_events())
        if not wire:
            return res.hit, []
        batch = decode_batch(encode_batch(EventBatch(time.time(), wire)))
        events = [msgspec.to_builtins(e) | {"type": type(e).__name__} for e in batch.events]
        return res.hit, json.loads(json.dumps(events))  # plain data, as the driver's JSON is


# ------------------------------------------------------------------------------------ the router
def vllm_chain(spec: Spec, seed: str) -> list[int]:
    """vLLM's sha256_cbor block hashes of a request, as 64-bit event ints: NONE_HASH is
    sha256(cbor(PYTHONHASHSEED)); block k is sha256(cbor((parent, tokens, extra_keys)))."""

    def h(obj: Any) -> bytes:
        return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

    parent, out, tokens = h(seed), [], spec["tokens"]
    for k in range(len(tokens) // BLOCK):
        s, e = k * BLOCK, (k + 1) * BLOCK
        keys: list[tuple[Any, ...]] = [("lora", *spec["lora"])] if spec["lora"] else []
        keys += [("mm", i, o - s) for i, o, n in spec["mm"] if n and o < e and o + n > s]
        if k == 0 and spec["salt"]:
            keys.append(("cache_salt", spec["salt"]))
        parent = h((parent, tuple(tokens[s:e]), tuple(keys) if keys else None))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


class Router:
    """What each replica's events announced, and the longest prefix of a request's recomputed
    hashes found there (the last prompt token is always computed, as vLLM and kvreuse do)."""

    def __init__(self, names: list[str]) -> None:
        self.held: dict[str, set[int]] = {n: set() for n in names}

    def apply(self, name: str, events: list[dict[str, Any]]) -> None:
        held = self.held[name]
        for ev in events:
            if ev["type"] == "BlockStored":
                held.update(ev["block_hashes"])
            elif ev["type"] == "BlockRemoved":
                held.difference_update(ev["block_hashes"])
            else:
                held.clear()

    def predict(self, name: str, spec: Spec, seed: str = SEED) -> int:
        hashes = vllm_chain(spec, seed)[: (len(spec["tokens"]) - 1) // BLOCK]
        n = 0
        while n < len(hashes) and hashes[n] in self.held[name]:
            n += 1
        return n * BLOCK


# ------------------------------------------------------------------------------------ tests
def per_block(events: list[dict[str, Any]]) -> tuple[list[tuple[Any, ...]], Counter[int]]:
    """Every stored block as (hash, parent, tokens, extra keys), in order, and the removals."""
    stored: list[tuple[Any, ...]] = []
    removed: Counter[int] = Counter()
    for ev in events:
        if ev["type"] == "BlockStored":
            n, parent = len(ev["block_hashes"]), ev["parent_block_hash"]
            extra = ev.get("extra_keys") or [None] * n
            assert len(extra) == n and len(ev["token_ids"]) == n * BLOCK
            for i, h in enumerate(ev["block_hashes"]):
                toks = ev["token_ids"][i * BLOCK : (i + 1) * BLOCK]
                stored.append((h, parent, toks, extra[i], ev.get("lora_name")))
                parent = h
        elif ev["type"] == "BlockRemoved":
            removed.update(ev["block_hashes"])
    return stored, removed


def stored_keys(events: list[dict[str, Any]]) -> list[Any]:
    return [e.get("extra_keys") for e in events if e["type"] == "BlockStored"]


@pytest.mark.parametrize("mode", ["groups", "routable"])
def test_same_blocks_hashes_parents_and_extra_keys_as_vllm(mode: str) -> None:
    ours = KvreuseReplica(mode)
    router = Router(["vllm", "kvreuse"])
    with vllm_replica() as theirs:
        assert ours.mgr.hasher.root.hex() == theirs.none_hash
        for spec in traffic(1):
            want = {
                "vllm": router.predict("vllm", spec),
                "kvreuse": router.predict("kvreuse", spec),
            }
            hit_v, ev_v = theirs.run(spec)
            hit_k, ev_k = ours.run(spec)
            assert hit_v == hit_k == want["vllm"] == want["kvreuse"], spec["id"]
            if mode == "groups":  # the routable mode announces a block once, as it settles
                assert per_block(ev_k) == per_block(ev_v), spec["id"]
                assert stored_keys(ev_k) == stored_keys(ev_v), spec["id"]  # None-for-none too
            router.apply("vllm", ev_v)
            router.apply("kvreuse", ev_k)
        assert router.held["vllm"] == router.held["kvreuse"]
        assert any(h for h in router.held["vllm"])


def test_every_extra_key_kind_was_exercised() -> None:
    """The traffic above meets LoRA, salt and multimodal keys, so the equality means something."""
    ours = KvreuseReplica("groups")
    kinds: set[str] = set()
    for spec in traffic(1):
        _, events = ours.run(spec)
        for ev in events:
            for keys in ev.get("extra_keys") or []:
                for key in keys or ():
                    if isinstance(key, list):
                        kinds.add("mm")
                    elif key == "fr":
                        kinds.add("lora")
                    elif key.startswith("tenant-"):
                        kinds.add("salt")
    assert kinds == {"mm", "lora", "salt"}


def test_default_seed_is_vllms_without_pythonhashseed() -> None:
    with vllm_replica(seed=None) as theirs:
        ours = KvreuseReplica("groups", seed=None)
        assert ours.mgr.hasher.root.hex() == theirs.none_hash
        spec = traffic(2, 1)[0]
        _, ev_v = theirs.run(spec)
        _, ev_k = ours.run(spec)
        assert per_block(ev_k) == per_block(ev_v)


@pytest.mark.parametrize("mode", ["groups", "routable"])
def test_mixed_fleet_behind_a_hash_recomputing_router(mode: str) -> None:
    """One vLLM replica and one kvreuse replica; the router sends each request where its
    recomputed hashes predict the longer hit (ties alternate) and every prediction is delivered."""
    ours = KvreuseReplica(mode)
    router = Router(["vllm", "kvreuse"])
    hits = 0
    with vllm_replica() as theirs:
        replicas = {"vllm": theirs, "kvreuse": ours}
        for i, spec in enumerate(traffic(3, 80)):
            want = {name: router.predict(name, spec) for name in replicas}
            order = ["vllm", "kvreuse"] if i % 2 else ["kvreuse", "vllm"]
            name = max(order, key=want.__getitem__)
            hit, events = replicas[name].run(spec)
            assert hit == want[name], (spec["id"], name)
            hits += hit
            router.apply(name, events)
    assert hits > 0
