"""Sweeps: one simulation per (geometry, tiers, cache capacity), run side by side.

Each case is `kvreuse simulate` in-process on a copy of the geometry whose pool holds the
case's capacity: C tokens become the blocks a geometry file's `capacity_tokens = C` asks for
(`blocks_for_capacity`), and `inf` a pool no run of this workload can fill (nothing is ever
evicted). A case's tiers below the pool (a `TierSetup`: none, a host tier, a store, both) are
sized as `kvreuse simulate --host-capacity` sizes them, whatever the pool. Cases run on local
worker processes (each parses the workload once), on a Ray cluster, or in this process, and
every way gives the same rows: a case is a pure function of the workload, its geometry, its
tiers and its capacity.
"""

from __future__ import annotations

import array
import importlib
import math
import multiprocessing
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any

from kvreuse.deployment import Deployment, blocks_for_capacity, check_num_blocks
from kvreuse.sched import DRAFT_ACCEPT_RATE
from kvreuse.sim.cost import CostModel
from kvreuse.sim.fit import request_lengths, unlimited_blocks
from kvreuse.sim.run import SimulationError, simulate
from kvreuse.sim.workload import WorkloadError, WorkloadRequest
from kvreuse.tiering import HOST_TIER, STORE_TIER, with_tiers
from kvreuse.vocab import MAX_NUM_BLOCKS, exact_size, parse_size, parse_sizes

MAX_CAPACITY = 10**15  # far beyond any pool: a larger value is a typo
# Blocks of the pools of the cases running at once (each in its own process on this machine):
# the ceiling of one pool, so a sweep of large pools runs fewer than --jobs at once.
MAX_BLOCKS_AT_ONCE = MAX_NUM_BLOCKS

Row = dict[str, Any]
OnCase = Callable[[int, int], None]  # (cases done, cases in all)


class CaseError(RuntimeError):
    """One case could not run; the message names the geometry and the capacity."""


def parse_capacities(text: str) -> list[int | None]:
    """'1M,3M,10M,50M,inf' → [1_000_000, 3_000_000, 10_000_000, 50_000_000, None]
    (`kvreuse.vocab.parse_sizes`; a ValueError naming the capacity otherwise)."""
    try:
        return parse_sizes(text, 1, MAX_CAPACITY, unlimited=True)
    except ValueError as exc:
        raise ValueError(f"capacity {exc}") from None


@dataclass(frozen=True)
class TierSetup:
    """The tiers below a case's pool, in tokens (`--host-capacity`, `--store-capacity`)."""

    host_tokens: int | None = None
    store_tokens: int | None = None

    @property
    def label(self) -> str:
        """'device only', 'host 30M', 'host 10M + store 20M'."""
        sizes = ((HOST_TIER, self.host_tokens), (STORE_TIER, self.store_tokens))
        parts = [f"{name} {exact_size(n)}" for name, n in sizes if n is not None]
        return " + ".join(parts) or "device only"


def parse_tier_setup(text: str) -> TierSetup:
    """'none' → no tiers; 'host=30M', 'host=10M,store=20M' → those tiers."""
    if text.strip().lower() == "none":
        return TierSetup()
    sizes: dict[str, int | None] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or name not in (HOST_TIER, STORE_TIER) or name in sizes:
            raise ValueError(
                f"{text!r}: give none, or host=N and/or store=N once each, "
                "comma-separated (host=10M,store=20M)"
            )
        try:
            sizes[name] = parse_size(value, 1, MAX_CAPACITY)
        except ValueError as exc:
            raise ValueError(f"{text!r}: {name} {exc}") from None
    return TierSetup(sizes.get(HOST_TIER), sizes.get(STORE_TIER))


@dataclass(frozen=True)
class Case:
    label: str  # the geometry as the command line named it
    deployment: Deployment  # its pool sized for `capacity`, its tiers `tiers`
    capacity: int | None  # tokens; None: unlimited
    tiers: str = "device only"  # the TierSetup's label


def cases_for(
    deployments: list[tuple[str, Deployment]],
    capacities: list[int | None],
    workload: list[WorkloadRequest],
    setups: tuple[TierSetup, ...] = (TierSetup(),),
    store_admission: str = "on-eviction",
) -> list[Case]:
    """Every (geometry, tier setup, capacity), in that order of nesting; a pool too large for
    this machine is a ValueError naming the case."""
    lengths: list[int] | None = None
    out = []
    for label, dep in deployments:
        for setup in setups:
            tiered = with_tiers(dep, setup.host_tokens, setup.store_tokens, store_admission)
            for capacity in capacities:
                if capacity is None:
                    lengths = lengths if lengths is not None else request_lengths(workload)
                    blocks = unlimited_blocks(dep, lengths)
                else:
                    blocks = blocks_for_capacity(dep.cache, capacity)
                check_num_blocks(blocks, f"{label} at capacity {exact_size(capacity)}")
                sized = replace(tiered, cache=replace(dep.cache, num_blocks=blocks))
                out.append(Case(label, sized, capacity, setup.label))
    return out


def run_case(case: Case, workload: list[WorkloadRequest], draft_accept_rate: float) -> Row:
    """The case's simulation and its row (CaseError if it cannot run)."""
    ttft = array.array("d")

    def collect(row: Row) -> None:
        if row["ttft_estimate_s"] is not None:
            ttft.append(row["ttft_estimate_s"])

    cost = CostModel.for_deployment(case.deployment)
    start = time.perf_counter()
    try:
        result = simulate(case.deployment, workload, cost, None, draft_accept_rate, sink=collect)
    except (WorkloadError, SimulationError, ValueError) as exc:
        where = f"{case.label} at capacity {exact_size(case.capacity)}"
        if case.tiers != TierSetup().label:
            where += f" ({case.tiers})"
        raise CaseError(f"{where}: {exc}") from None
    s = result.summary
    times = sorted(ttft)
    return {
        "geometry": case.label,
        "tier_setup": case.tiers,
        "capacity_tokens": case.capacity,
        "num_blocks": case.deployment.cache.num_blocks,
        "requests": s["requests"],
        "prompt_tokens": s["queries"],
        "cached_tokens": s["hits"],
        "hit_rate": s["hit_rate"],
        "prefill_tokens": s["prefill_tokens_computed"],
        "prefill_seconds": s.get("prefill_seconds"),
        "saved_states": s.get("saved_states"),
        "simulated_seconds": s["simulated_seconds"],
        "ttft_p50_s": percentile(times, 50),
        "ttft_p90_s": percentile(times, 90),
        "ttft_p99_s": percentile(times, 99),
        "preemptions": s["preemptions"],
        "evicted_blocks": s["evicted_blocks"],
        "peak_usage": s["peak_usage"],
        "too_large": s["too_large"]["count"],
        "reconciled": s["reconciled"],
        "wall_s": round(time.perf_counter() - start, 3),
        **({"tiers": s["tiers"]} if "tiers" in s else {}),
    }


def percentile(ordered: Any, q: float) -> float | None:
    """The nearest-rank q-th percentile of ascending values (None for none)."""
    if not len(ordered):
        return None
    return float(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)])


# ---------------------------------------------------------------------------- running cases
_WORKLOAD: list[WorkloadRequest] = []  # a worker process's copy, set once by its initializer


def _init_worker(workload: list[WorkloadRequest]) -> None:
    # Ctrl-C is the parent's to handle: it stops the workers itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _WORKLOAD
    _WORKLOAD = workload


def _run_in_worker(case: Case, draft_accept_rate: float) -> Row:
    return run_case(case, _WORKLOAD, draft_accept_rate)


def run_cases(
    cases: list[Case],
    workload: list[WorkloadRequest],
    jobs: int,
    draft_accept_rate: float = DRAFT_ACCEPT_RATE,
    on_case: OnCase | None = None,
    done: list[Row] | None = None,
) -> list[Row]:
    """Every case's row, in case order: in this process (jobs = 1) or on `jobs` worker
    processes. Rows finished so far are appended to `done` as they come (what an interrupted
    sweep still has)."""
    done = [] if done is None else done
    rows: dict[int, Row] = {}
    for i, row in _completions(cases, workload, jobs, draft_accept_rate):
        rows[i] = row
        done.append(row)
        if on_case is not None:
            on_case(len(rows), len(cases))
    return [rows[i] for i in range(len(cases))]


def _completions(
    cases: list[Case], workload: list[WorkloadRequest], jobs: int, rate: float
) -> Iterator[tuple[int, Row]]:
    if jobs <= 1 or len(cases) <= 1:
        for i, case in enumerate(cases):
            yield i, run_case(case, workload, rate)
        return
    # fork where there is one: the workers get the parsed workload without copying it
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else None)
    pool = ProcessPoolExecutor(
        min(jobs, len(cases)), context, initializer=_init_worker, initargs=(workload,)
    )
    try:
        yield from _throttled(pool, cases, min(jobs, len(cases)), rate)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for child in multiprocessing.active_children():  # the pool's workers: stop them now
            child.terminate()
        raise
    pool.shutdown()


def _throttled(
    pool: ProcessPoolExecutor, cases: list[Case], workers: int, rate: float
) -> Iterator[tuple[int, Row]]:
    """The cases on `pool`, in case order, at most `workers` at once and, past the first, only
    while the pools of those running hold MAX_BLOCKS_AT_ONCE blocks or fewer in all: the cases
    run on this machine together, so the ceiling of one pool bounds them together (each case
    alone is within it: `cases_for` checked)."""
    running: dict[Future[Row], int] = {}
    held, next_case = 0, 0  # blocks of the running cases; the next case to submit
    while next_case < len(cases) or running:
        while next_case < len(cases) and len(running) < workers:
            need = cases[next_case].deployment.cache.num_blocks
            if running and held + need > MAX_BLOCKS_AT_ONCE:
                break  # it waits for the running ones to make room
            running[pool.submit(_run_in_worker, cases[next_case], rate)] = next_case
            held += need
            next_case += 1
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        for future in finished:
            i = running.pop(future)
            held -= cases[i].deployment.cache.num_blocks
            yield i, future.result()


def run_cases_on_ray(
    cases: list[Case],
    workload: list[WorkloadRequest],
    address: str | None,
    draft_accept_rate: float = DRAFT_ACCEPT_RATE,
    on_case: OnCase | None = None,
    done: list[Row] | None = None,
) -> list[Row]:
    """`run_cases` as Ray tasks: on the cluster at `address`, or a local one (None). The
    workload goes to the object store once; every node needs kvreuse installed."""
    ray = importlib.import_module("ray")  # optional (the `ray` extra): typed as Any

    done = [] if done is None else done
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    task = ray.remote(num_cpus=1)(run_case)
    shared = ray.put(workload)
    refs = {task.remote(case, shared, draft_accept_rate): i for i, case in enumerate(cases)}
    rows: dict[int, Row] = {}
    pending = list(refs)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            i = refs[ready[0]]
            try:
                rows[i] = ray.get(ready[0])
            except ray.exceptions.RayTaskError as exc:  # the task's own error, not Ray's wrapper
                cause = exc.cause
                if isinstance(cause, CaseError):
                    raise CaseError(str(cause)) from None
                raise CaseError(f"a Ray task failed: {cause!r}") from None
            done.append(rows[i])
            if on_case is not None:
                on_case(len(rows), len(cases))
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        raise
    return [rows[i] for i in range(len(cases))]
