"""The qualify scenarios, sized from the server's geometry (u, page size, cache size)."""

from __future__ import annotations

import math

from kvreuse.qualify.runner import Runner

M = 4  # output tokens of most requests: greedy answers are compared cold vs warm


def _sizes(runner: Runner) -> tuple[int, int, int]:
    geo = runner.deployment.cache.geometry
    u = geo.hash_unit
    pages = [g.page_size for g in geo.groups if g.is_attention] or [u]
    limit = runner.client.max_model_len or runner.deployment.max_model_len or 8192
    return u, max(pages), limit


def run_all(runner: Runner, quick: bool, max_fill: int | None = None) -> None:
    u, page, limit = _sizes(runner)
    grid(runner, u, page, limit, quick)
    shared_prefix(runner, u, page, limit, quick)
    agent(runner, u, page, limit, quick)
    retrieval(runner, limit, quick)
    budget = max_fill if max_fill is not None else (12_000 if quick else 60_000)
    pressure(runner, page, limit, quick, budget)


def grid(runner: Runner, u: int, page: int, limit: int, quick: bool) -> None:
    lengths = [u - 1, u, u + 1, page - 1, page + 1]
    if not quick:
        lengths += [page, 2 * page + u // 2, 8 * page - 1, 8 * page + 1]
    extra = u // 2 + 1
    with runner.scenario("a-grid"):
        for n in sorted({n for n in lengths if 0 < n < limit - M - extra}):
            prompt = runner.tokens(n)
            cold = runner.send(f"cold-{n}", prompt, M)
            runner.send(f"warm-{n}", prompt, M, same_as=cold)
            runner.send(f"appended-{n}", prompt + runner.tokens(extra), M)


def shared_prefix(runner: Runner, u: int, page: int, limit: int, quick: bool) -> None:
    q = min((2 if quick else 8) * page + u // 2, limit // 2)
    prefix = runner.tokens(q)
    with runner.scenario("b-shared-prefix"):
        for i in range(4 if quick else 8):
            runner.send(f"suffix-{i}", prefix + runner.tokens(2 * u), M, stream=i % 2 == 1)


def agent(runner: Runner, u: int, page: int, limit: int, quick: bool) -> None:
    turns, user = (8 if quick else 64), 2 * u
    history = runner.tokens(page)  # the system prompt
    with runner.scenario("c-agent"):
        for t in range(turns):
            history = history + runner.tokens(user)
            if len(history) + M >= limit:
                break
            history = history + runner.send(f"turn-{t}", history, M)


def retrieval(runner: Runner, limit: int, quick: bool) -> None:
    n = min(limit - 64, 1024 if quick else 6144)
    doc = runner.tokens(n)
    with runner.scenario("d-retrieval"):
        cold = runner.send(f"cold-{n}", doc, M)
        runner.send(f"warm-{n}", doc, M, stream=True, same_as=cold)
        runner.send("question", doc + runner.tokens(32), M)


def pressure(runner: Runner, page: int, limit: int, quick: bool, budget: int) -> None:
    """Fill the cache past capacity with distinct sequences, then replay them twice, newest
    first: the newest are still resident, the oldest were evicted (and evict others in turn)."""
    cfg = runner.deployment.cache
    length = min(page, limit // 2)
    recurrent = sum(1 for g in cfg.geometry.groups if not g.is_attention)
    per = -(-length // page) + recurrent  # what a finished sequence leaves resident, at least
    count = math.ceil(1.25 * (cfg.num_blocks - 1) / per)
    with runner.scenario("e-pressure") as sc:
        if 3 * count * length > budget:
            sc.skipped = (
                f"filling {cfg.num_blocks} blocks needs {3 * count * length} tokens; "
                f"over the budget of {budget} (--max-fill-tokens)"
            )
            return
        seqs = [runner.tokens(length) for _ in range(count)]
        first = [runner.send(f"fill-{i}", s, 1) for i, s in enumerate(seqs)]
        for r in (1, 2):
            for i in reversed(range(count)):
                runner.send(f"replay{r}-{i}", seqs[i], 1, same_as=first[i])
