"""Serve, simulate and the scheduler agree on which requests fit, on every preset.

For each preset, a pool is chosen whose largest fitting prompt is a few hundred tokens (or the
context limit, for a geometry whose pages are larger than that). The boundary is found by
running requests through the scheduler alone; then every prompt length around it goes through
the three paths a user meets: `kvreuse serve` (a 400 naming the blocks, or an answer that runs
to max_tokens), `kvreuse simulate` (refused as too large, or run), and the scheduler itself.
All three must give the same answer for every length, and both answers must occur.
"""

from __future__ import annotations

import json
from dataclasses import replace

import httpx
import pytest

from kvreuse import KVCacheManager, Request
from kvreuse.deployment import PRESETS, Deployment, preset
from kvreuse.sched import FakeEngine, Scheduler, peak_blocks
from kvreuse.serve import fake_backend
from kvreuse.serve.app import create_app
from kvreuse.serve.server import ServerThread
from kvreuse.sim.run import simulate
from kvreuse.sim.workload import load_workload

MAX_TOKENS = 4
SERVED_LIMIT = 2048  # the fake backend's context length where the geometry names none


def _tokens(n: int) -> list[int]:
    """A prompt of n tokens sharing no unit with another length's: every request runs cold (a
    hit moves the chunks, and a partial hit page is copied, so a warm peak can differ)."""
    return [(5 * i + n) % 200 for i in range(n)]


def _scheduler_runs(dep: Deployment, n: int) -> bool:
    sched = Scheduler(KVCacheManager(dep.cache), FakeEngine(), dep.sched)
    seq = sched.add(Request("r", _tokens(n)), max_tokens=MAX_TOKENS)
    while sched.has_work():
        sched.step()
    assert seq.finish_reason in ("length", "too_large")
    return seq.finish_reason == "length"


def _simulate_runs(dep: Deployment, n: int) -> bool:
    line = {"id": "r", "prompt": {"tokens": _tokens(n)}, "max_tokens": MAX_TOKENS}
    count = simulate(dep, load_workload([json.dumps(line)])).summary["too_large"]["count"]
    assert count in (0, 1)
    return count == 0


def _serve_runs(url: str, n: int) -> bool:
    body = {"model": "kvreuse-fake", "prompt": _tokens(n), "max_tokens": MAX_TOKENS}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    if r.status_code == 400:
        assert "KV blocks at its peak; the cache has" in r.json()["error"]["message"]
        return False
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    return True


def _boundary(dep: Deployment, limit: int) -> int:
    """A prompt length that runs while the next one does not (or the limit, if it runs)."""
    if _scheduler_runs(dep, limit):
        return limit
    lo, hi = 1, limit  # lo runs, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _scheduler_runs(dep, mid) else (lo, mid)
    return lo


@pytest.mark.parametrize("name", list(PRESETS))
def test_serve_simulate_and_the_scheduler_agree_on_the_largest_request(name: str) -> None:
    dep = preset(name)
    num_blocks = 1 + peak_blocks(dep.cache.geometry, dep.sched, 300, MAX_TOKENS)
    dep = replace(dep, cache=replace(dep.cache, num_blocks=num_blocks))
    limit = (dep.max_model_len or SERVED_LIMIT) - MAX_TOKENS
    largest = _boundary(dep, limit)
    lengths = [n for n in range(largest - 2, largest + 4) if 1 <= n <= limit]
    with ServerThread(create_app(fake_backend(name, num_blocks=num_blocks))) as url:
        answers = {
            n: (_scheduler_runs(dep, n), _simulate_runs(dep, n), _serve_runs(url, n))
            for n in lengths
        }
    assert all(len(set(a)) == 1 for a in answers.values()), answers
    assert answers[largest][0]
    if largest < limit:
        assert not answers[largest + 1][0]
