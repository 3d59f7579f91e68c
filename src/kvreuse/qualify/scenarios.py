"""The qualify scenarios, sized from the server's geometry (hash unit, page size, cache size)."""

from __future__ import annotations

import math

from kvreuse.qualify.runner import Runner

MAX_TOKENS = 4  # output tokens of most requests: greedy answers are compared cold vs warm


def _sizes(runner: Runner) -> tuple[int, int, int]:
    geo = runner.deployment.cache.geometry
    pages = [g.page_size for g in geo.groups if g.is_attention] or [geo.hash_unit]
    limit = runner.client.max_model_len or runner.deployment.max_model_len or 8192
    return geo.hash_unit, max(pages), limit


def run_all(runner: Runner, quick: bool, max_fill: int | None = None) -> None:
    hash_unit, page, limit = _sizes(runner)
    grid(runner, hash_unit, page, limit, quick)
    shared_prefix(runner, hash_unit, page, limit, quick)
    agent(runner, hash_unit, page, limit, quick)
    retrieval(runner, limit, quick)
    budget = max_fill if max_fill is not None else (12_000 if quick else 60_000)
    pressure(runner, page, limit, quick, budget)


def grid(runner: Runner, hash_unit: int, page: int, limit: int, quick: bool) -> None:
    lengths = [hash_unit - 1, hash_unit, hash_unit + 1, page - 1, page + 1]
    if not quick:
        lengths += [page, 2 * page + hash_unit // 2, 8 * page - 1, 8 * page + 1]
    extra = hash_unit // 2 + 1
    with runner.scenario("a-grid"):
        for n in sorted({n for n in lengths if 0 < n < limit - MAX_TOKENS - extra}):
            prompt = runner.tokens(n)
            cold = runner.send(f"cold-{n}", prompt, MAX_TOKENS)
            runner.send(f"warm-{n}", prompt, MAX_TOKENS, same_as=cold)
            runner.send(f"appended-{n}", prompt + runner.tokens(extra), MAX_TOKENS)


def shared_prefix(runner: Runner, hash_unit: int, page: int, limit: int, quick: bool) -> None:
    q = min((2 if quick else 8) * page + hash_unit // 2, limit // 2)
    prefix = runner.tokens(q)
    with runner.scenario("b-shared-prefix"):
        for i in range(4 if quick else 8):
            runner.send(
                f"suffix-{i}",
                prefix + runner.tokens(2 * hash_unit),
                MAX_TOKENS,
                stream=i % 2 == 1,
            )


def agent(runner: Runner, hash_unit: int, page: int, limit: int, quick: bool) -> None:
    turns, user = (8 if quick else 64), 2 * hash_unit
    history = runner.tokens(page)  # the system prompt
    with runner.scenario("c-agent"):
        for t in range(turns):
            history = history + runner.tokens(user)
            if len(history) + MAX_TOKENS >= limit:
                break
            history = history + runner.send(f"turn-{t}", history, MAX_TOKENS)


def retrieval(runner: Runner, limit: int, quick: bool) -> None:
    n = min(limit - 64, 1024 if quick else 6144)
    doc = runner.tokens(n)
    with runner.scenario("d-retrieval"):
        cold = runner.send(f"cold-{n}", doc, MAX_TOKENS)
        runner.send(f"warm-{n}", doc, MAX_TOKENS, stream=True, same_as=cold)
        runner.send("question", doc + runner.tokens(32), MAX_TOKENS)


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
