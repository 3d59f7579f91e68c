"""Whether a workload's requests fit a pool, found before the run: the scheduler refuses a
request whose full-attention pages for prompt + max_tokens − 1 outnumber the pool's usable
blocks (`Scheduler.add`), and every such request is known from the workload's lengths alone.
A run on a preset's own pool that would refuse some is refused up front with the capacity
that fits them; on a pool the user chose, the run is told about them first and goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvreuse.core import Geometry
from kvreuse.deployment import Deployment
from kvreuse.sim.feed import Arrivals, static_length
from kvreuse.sim.workload import WorkloadError, WorkloadRequest
from kvreuse.vocab import plural, size_at_least


def min_blocks(geo: Geometry, num_tokens: int) -> int:
    """The scheduler's lower bound of the blocks a request computing `num_tokens` holds at
    once: every page of a full-attention group, one page of a window group, a recurrent
    group's live state and scratch (`Scheduler.min_blocks`)."""
    return sum(g.min_blocks_held(num_tokens) for g in geo.groups)


@dataclass(frozen=True)
class Fit:
    num_requests: int
    num_too_large: int  # requests the pool can never hold, even alone
    largest_tokens: int  # the most tokens one request computes (prompt + max_tokens − 1)
    largest_id: str

    def message(self, dep: Deployment) -> str:
        """'10 of 3,993 requests do not fit attention-16's pool …: --capacity-tokens 164K …'."""
        cap = dep.cache.capacity_tokens()
        pool = plural(dep.cache.num_blocks, "block") + (f", {plural(cap, 'token')}" if cap else "")
        return (
            f"{self.num_too_large:,} of {plural(self.num_requests, 'request')} can never fit "
            f"{dep.name}'s pool ({pool}) and would be refused; the largest, {self.largest_id}, "
            f"computes {self.largest_tokens:,} tokens: --capacity-tokens "
            f"{size_at_least(self.largest_tokens)} fits every request (inf: a pool that never "
            "evicts)"
        )


def check_fit(dep: Deployment, workload: list[WorkloadRequest]) -> Fit:
    """How many of the workload's requests the pool of `dep` can never hold. The run's own
    checks of the lengths known before it come first (a WorkloadError, as the run raises)."""
    Arrivals(workload, dep.max_model_len)
    geo = dep.cache.geometry
    usable = dep.cache.num_blocks - 1  # the null block is never handed out
    num_too_large, largest, largest_id = 0, 0, ""
    for w, bound in zip(workload, request_lengths(workload), strict=True):
        n = bound - 1  # prompt + max_tokens − 1: the last step computes that many
        if min_blocks(geo, n) > usable:
            num_too_large += 1
        if n > largest:
            largest, largest_id = n, w.request_id
    return Fit(len(workload), num_too_large, largest, largest_id)


def never_evicting_blocks(dep: Deployment, workload: list[WorkloadRequest]) -> int:
    """The pool of `--capacity-tokens inf`: more blocks than the workload can ever take."""
    return unlimited_blocks(dep, request_lengths(workload))


def request_lengths(workload: list[WorkloadRequest]) -> list[int]:
    """Per request, a bound on the tokens it ever holds: its prompt (a quoted history counts
    that request's bound) plus max_tokens."""
    bound: dict[str, int] = {}
    out = []
    for w in workload:
        n = _prompt_bound(w.prompt, bound) + w.max_tokens
        bound[w.request_id] = n
        out.append(n)
    return out


def _prompt_bound(prompt: Any, bound: dict[str, int]) -> int:
    kind, value = next(iter(prompt.items()))
    if kind == "history":
        return bound[value]
    if kind == "concat":
        return sum(_prompt_bound(part, bound) for part in value)
    n = static_length(prompt)
    if n is None:  # every other kind has its length in the line
        raise WorkloadError(f"prompt kind {kind!r} has no length known before the run")
    return n


def unlimited_blocks(geo: Deployment, lengths: list[int]) -> int:
    """A pool larger than every block this workload's requests can ever take from it, so no
    entry is ever evicted: per request, its attention pages plus one copy-on-write page per
    attention group, and per recurrent group its slots plus two states per unit it computes
    (rolling, planned and dense saves land on distinct unit boundaries)."""
    cache = geo.cache
    g = cache.geometry
    spec = geo.sched.num_spec_tokens  # a decode step's draft slots
    num_attention = sum(1 for grp in g.groups if grp.is_attention)
    num_recurrent = len(g.groups) - num_attention
    total = 1
    for n in lengths:
        total += cache.blocks_for_request(n, spec) + num_attention
        total += num_recurrent * (2 * (-(-n // g.hash_unit)) + 8)
    return total
