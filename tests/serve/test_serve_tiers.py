"""The server with a host tier below its cache: an evicted prompt's resend loads its prefix back
from the tier, and /metrics says so per tier in vLLM's terms (prompt tokens by source, external
prefix-cache hits, bytes moved), reconciling with the usage blocks the client received."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI

from kvreuse.serve import fake_backend
from kvreuse.serve.app import create_app
from kvreuse.serve.backend import Backend, TierOptions
from kvreuse.serve.server import ServerThread
from serve_util import scrape

HOST = '{medium="CPU",tier="host"}'  # labels as the scrape keys them: sorted


def _served(backend: Backend) -> Iterator[tuple[OpenAI, str, Backend]]:
    with (
        ServerThread(create_app(backend)) as url,
        OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as client,
    ):
        yield client, url, backend


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[OpenAI, str, Backend]]:
    # 40 blocks: a few 300-token prompts evict each other; the host keeps 20,000 tokens' worth
    yield from _served(fake_backend(num_blocks=40, tiers=TierOptions(host_tokens=20_000)))


def _cached(client: OpenAI, model: str, prompt: str) -> tuple[int, str]:
    hit, text, _ = _answer(client, model, prompt)
    return hit, text


def _answer(client: OpenAI, model: str, prompt: str) -> tuple[int, str, Any]:
    """The hit, the text and where the hit came from (`cached_tokens_by_medium`, or None)."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    details = r.usage.prompt_tokens_details
    by_medium = (details.model_extra or {}).get("cached_tokens_by_medium")
    return details.cached_tokens, r.choices[0].text, by_medium


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _evict_and_resend(client: OpenAI, url: str, model: str, prompt: str) -> dict[str, Any]:
    """Send `prompt`, flood the cache with other prompts until none of it stays on the device,
    resend it; the two answers, the resend's hit and the metrics before and after it."""
    _, cold_text = _cached(client, model, prompt)
    for i in range(6):
        _cached(client, model, f"{i} flood " * 40)
    before = scrape(url)
    hit, warm_text, by_medium = _answer(client, model, prompt)
    after = scrape(url)
    return {"cold": cold_text, "warm": warm_text, "hit": hit, "by_medium": by_medium,
            "before": before, "after": after}  # fmt: skip


def test_an_evicted_prompt_comes_back_from_the_host(fake: tuple[OpenAI, str, Backend]) -> None:
    client, url, backend = fake
    u = backend.mgr.geo.hash_unit
    prompt = ("tiers " * 60)[:300]
    got = _evict_and_resend(client, url, "kvreuse-fake", prompt)
    before, after = got["before"], got["after"]
    # the same reuse as if the prompt had stayed on the device (a state at every unit boundary
    # the fake saves: the last one before the prompt's last token)
    assert got["hit"] == (300 - 1) // u * u and got["warm"] == got["cold"]
    from_host = _delta(after, before, f"kvreuse:kv_tier_hits_total{HOST}")
    assert 0 < from_host <= got["hit"]
    assert _delta(after, before, "kvreuse:external_prefix_cache_hits_total") == from_host
    # and the answer says where its cached tokens came from
    assert got["by_medium"] == {"GPU": got["hit"] - from_host, "CPU": from_host}
    state = 'kvreuse:kv_tier_loaded_blocks_total{group_kind="recurrent",medium="CPU",tier="host"}'
    assert _delta(after, before, state) == 1  # the state at the hit, with its pages
    # vLLM's split of the resend's prompt tokens adds up to what it asked and what it hit
    source = 'kvreuse:prompt_tokens_by_source_total{{source="{}"}}'
    parts = {s: _delta(after, before, source.format(s))
             for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}  # fmt: skip
    assert parts["external_kv_transfer"] == from_host
    assert parts["local_cache_hit"] + from_host == got["hit"]
    assert sum(parts.values()) == 300
    assert _delta(after, before, "kvreuse:external_prefix_cache_queries_total") == 300
    held = after[f"kvreuse:kv_tier_blocks{HOST}"]
    room = after[f"kvreuse:kv_tier_capacity_blocks{HOST}"]
    assert 0 < held <= room and after[f"kvreuse:kv_tier_usage_perc{HOST}"] == held / room
    assert after[f"kvreuse:kv_tier_stored_blocks_total{HOST}"] >= held
    assert "kvreuse:kv_offload_total_bytes_total" not in str(after)  # a fake moves no bytes


def test_without_tiers_the_tier_families_are_absent() -> None:
    for client, url, _ in _served(fake_backend(num_blocks=40)):
        assert _answer(client, "kvreuse-fake", "no tiers here " * 10)[2] is None
        names = scrape(url)
        shared = httpx.get(url + "/kvreuse/store")
        assert shared.status_code == 404 and "shares no store" in shared.json()["error"]["message"]
        assert not [n for n in names if "tier" in n or n.startswith("kvreuse:external")]
        source = 'kvreuse:prompt_tokens_by_source_total{source="external_kv_transfer"}'
        assert names[source] == 0


def test_the_engine_moves_the_bytes_the_metrics_count() -> None:
    pytest.importorskip("torch", reason="needs torch: pip install -e '.[engine]'")
    from kvreuse.serve import default_backend

    backend = default_backend(num_blocks=16, tiers=TierOptions(host_tokens=20_000))
    runner = backend.scheduler.engine
    for client, url, _ in _served(backend):
        prompt = "The host tier keeps what the device evicts. " * 7
        got = _evict_and_resend(client, url, backend.name, prompt)
        assert got["warm"] == got["cold"] and got["hit"] > 0
        after = scrape(url)
        tiers = backend.mgr.metrics()["tiers"]["host"]
        # every byte the engine counts is a whole block of its group, as the core planned
        per_block = {
            g.kind: sum(t.numel() * t.element_size() for t in block.values())
            for g in backend.mgr.geo.groups
            for block in [runner.cache.read_block(g.group_id, 1)]
        }
        loaded = sum(per_block[k] * n for k, n in tiers["loaded_blocks"].items())
        way = 'kvreuse:kv_offload_total_bytes_total{{transfer_type="{}"}}'
        assert after[way.format("CPU_to_GPU")] == loaded > 0
        assert after[way.format("GPU_to_CPU")] > 0


def test_serve_refuses_a_store_without_its_server() -> None:
    for args, words in (
        (["--store-capacity", "1M"], "--store-capacity needs --store-url"),
        (["--fake", "--store-url", "redis://127.0.0.1:1/0"], "give --store-capacity too"),
        (["--fake", "--store-capacity", "1M", "--store-url", "http://x"], "must be a redis://"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "kvreuse", "serve", "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and words in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
