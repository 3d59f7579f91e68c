"""Whether a request fits the pool: the most blocks it holds at once when it runs alone.

One rule for every caller: the scheduler refuses a request whose peak exceeds the pool's usable
blocks (`Scheduler.add`), the server answers 400 before queueing it, and the simulator counts
such requests before a run. A request that fits runs to its end on an otherwise empty pool.

A lone request's steps from an empty cache, as the scheduler cuts them (P prompt tokens,
m = max_tokens, d drafts per decode step, C = max_num_batched_tokens):

    prefill   [0, c1) [c1, c2) … [ck, P)    chunks of at most C tokens, each also ending at
                                            the next position the core saves a state at
    decode    [s, s + 1 + d)                for s = P … P + m − 2: a step that accepts no
                                            draft advances one token, so every s is a step
                                            in the worst case

At a step [s, e) each group holds:

    paged      ⌈e / page⌉ − needed_from(s)   the pages from the first one still attended to
    recurrent  1 + scratch + held(s)         live state, scratch, and the rolling states kept
                                             since the last commit: min(κ + 1, ⌊s / u⌋)

The step's own saves are popped best effort (a full pool skips them), so they do not count.
The peak is the largest sum over the steps. Decode steps need not all be visited: full
attention only grows with s, held states only grow, and a group that frees pages repeats
itself every lcm(page, its free marks' moduli) tokens, so the last such period of decode
steps holds the decode peak.

A hit changes where the chunks start, so a warm request's peak can differ from this cold one
by a page of a window group; the scheduler still refuses a request that preempts itself with
nothing else running, so such a request is refused, not stuck (docs/decisions.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from kvreuse.core import Geometry
from kvreuse.core.spi import replay_point
from kvreuse.sched.config import SchedulerConfig


def peak_blocks(geo: Geometry, config: SchedulerConfig, num_prompt: int, max_tokens: int) -> int:
    """The most blocks a request of `num_prompt` tokens generating `max_tokens` holds at once
    when it runs alone from an empty cache (the step's best-effort saves excluded)."""
    if num_prompt < 1 or max_tokens < 1:
        raise ValueError(f"num_prompt and max_tokens must be ≥ 1, got {num_prompt}, {max_tokens}")
    return max(_held(geo, s, e) for s, e in _steps(geo, config, num_prompt, max_tokens))


def _steps(
    geo: Geometry, config: SchedulerConfig, num_prompt: int, max_tokens: int
) -> Iterator[tuple[int, int]]:
    """The prefill chunks, then the decode steps that can hold the decode peak."""
    budget = config.max_num_batched_tokens
    cuts = iter(first_save_positions(geo, num_prompt) if config.chunk_at_save_positions else ())
    cut = next(cuts, None)
    start = 0
    while start < num_prompt:
        end = min(num_prompt, start + budget)
        while cut is not None and cut <= start:
            cut = next(cuts, None)
        if cut is not None and cut < end:
            end = cut
        yield start, end
        start = end
    last = num_prompt + max_tokens - 2  # the step that samples the last token starts here
    first = max(num_prompt, last - _period(geo) + 1)
    decode = 1 + config.num_spec_tokens
    for s in range(first, last + 1):
        yield s, s + decode


def _held(geo: Geometry, start: int, end: int) -> int:
    """The blocks a lone request holds while the step [start, end) runs."""
    held = 0
    rolling = min(geo.kappa + 1, start // geo.hash_unit) if geo.caching_enabled else 0
    for g in geo.groups:
        if g.is_attention:
            held += -(-end // g.page_size) - g.needed_from(start)
        else:
            held += 1 + g.scratch + rolling
    return held


def _period(geo: Geometry) -> int:
    """Decode steps after which every group holds at least what it held a period before."""
    period = 1
    for g in geo.paged:
        for modulus, _ in g.free_marks():
            period = math.lcm(period, g.page_size, modulus)
    return period


def first_save_positions(geo: Geometry, num_prompt: int) -> list[int]:
    """The positions a request's prefill chunks end at on its first run, ascending: where the
    core plans its states (the replay point ρ and its multiples of M and S, every multiple of M
    under dense retention) and the last κ + 1 unit boundaries of the prompt (the rolling states
    a finish publishes). The manager's `save_positions` of a request admitted with no hit."""
    if not geo.caching_enabled or not geo.recurrent:
        return []
    u, common = geo.hash_unit, geo.common_page
    hashed = max(0, (num_prompt - geo.lookahead) // u) * u  # what the chain can prove
    rho = replay_point(geo, num_prompt)
    out: set[int] = set()
    for g in geo.recurrent:
        M = g.page_size
        out.update(c for c in (rho, rho // M * M, rho // common * common) if 0 < c <= hashed)
        if geo.dense_retention:
            out.update(range(M, num_prompt + 1, M))
    top = num_prompt // u * u
    out.update(c for c in (top - geo.kappa * u, top) if c > 0)
    return sorted(out)
