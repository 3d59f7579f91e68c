"""Whether a workload's requests fit a pool, found before the run: the scheduler refuses a
request whose peak (`kvreuse.sched.fit`) exceeds the pool's usable blocks, and every such
request is known from the workload's lengths alone. A run on a preset's own pool that would
refuse some is refused up front with the capacity that fits them; on a pool the user chose,
the run is told about them first and goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvreuse.core import CacheConfig
from kvreuse.deployment import Deployment
from kvreuse.sched import peak_blocks
from kvreuse.sim.feed import Arrivals, static_length
from kvreuse.sim.workload import WorkloadError, WorkloadRequest
from kvreuse.vocab import plural, size_at_least


@dataclass(frozen=True)
class Fit:
    num_requests: int
    num_too_large: int  # requests the pool can never hold, even alone
    largest_blocks: int  # the highest peak of one request (kvreuse.sched.fit)
    largest_id: str

    def message(self, dep: Deployment) -> str:
        """'10 of 3,993 requests can never fit attention-16's pool …: --capacity-tokens 164K
        fits every request …'."""
        cap = dep.cache.capacity_tokens()
        pool = plural(dep.cache.num_blocks, "block") + (f", {plural(cap, 'token')}" if cap else "")
        fitting = capacity_for(dep.cache, self.largest_blocks)
        return (
            f"{self.num_too_large:,} of {plural(self.num_requests, 'request')} can never fit "
            f"{dep.name}'s pool ({pool}) and would be refused; the largest, {self.largest_id}, "
            f"holds {plural(self.largest_blocks, 'block')} at its peak: --capacity-tokens "
            f"{size_at_least(fitting)} fits every request (inf: a pool that never evicts)"
        )


def check_fit(dep: Deployment, workload: list[WorkloadRequest]) -> Fit:
    """How many of the workload's requests the pool of `dep` can never hold. The run's own
    checks of the lengths known before it come first (a WorkloadError, as the run raises)."""
    Arrivals(workload, dep.max_model_len)
    geo = dep.cache.geometry
    usable = dep.cache.num_blocks - 1  # the null block is never handed out
    num_too_large, largest, largest_id = 0, 0, ""
    for w, bound in zip(workload, request_lengths(workload), strict=True):
        peak = peak_blocks(geo, dep.sched, bound - w.max_tokens, w.max_tokens)
        if peak > usable:
            num_too_large += 1
        if peak > largest:
            largest, largest_id = peak, w.request_id
    return Fit(len(workload), num_too_large, largest, largest_id)


def capacity_for(cache: CacheConfig, num_blocks: int) -> int:
    """The smallest --capacity-tokens whose pool (`blocks_for_capacity`) has `num_blocks`
    usable blocks: one token more than the largest capacity of a pool one block short."""
    below = cache.capacity_tokens(num_blocks)  # the most tokens num_blocks − 1 usable hold
    return 1 if below is None else below + 1


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


def unlimited_blocks(dep: Deployment, lengths: list[int]) -> int:
    """A pool larger than every block this workload's requests can ever take from it, so no
    entry is ever evicted: per request, its attention pages plus one copy-on-write page per
    attention group, and per recurrent group its slots plus two states per unit it computes
    (rolling, planned and dense saves land on distinct unit boundaries)."""
    cache = dep.cache
    geo = cache.geometry
    spec = dep.sched.num_spec_tokens  # a decode step's draft slots
    num_attention = sum(1 for grp in geo.groups if grp.is_attention)
    num_recurrent = len(geo.groups) - num_attention
    total = 1
    for n in lengths:
        total += cache.blocks_for_request(n, spec) + num_attention
        total += num_recurrent * (2 * (-(-n // geo.hash_unit)) + 8)
    return total
