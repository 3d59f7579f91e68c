"""A continuous-batching scheduler over the core.

One `step()` reads as its table of contents:

    grow running requests (decode first, then prefill chunks)   ─┐ within the token budget and
    admit waiting requests, FCFS                                  ─┘ max_num_seqs; preempt on OOM
    seal the step → run the engine → commit the outcomes
    finish requests that reached max_tokens or a stop token

It drives the core only through its public operations (spec §3): lookup, allocate (and
allocate_many, which grows every decoding request of a step in one call), next_save_position,
seal_step, commit_batch (or commit), finish, preempt. The engine is any callable that turns a
`StepPlan` into the core's outcomes: `kvreuse.engine.ModelRunner` runs a model, and
`ScriptedEngine` (in `kvreuse.sched.engine`) emits deterministic tokens for simulation and tests.
An engine with a `run_tier_ops(ops)` method is also handed, as the step ends, the tier ops its
commit and finishes decided (a write-through tier's copies).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from kvreuse.core import KVCacheManager, Request, RequestStats, StepPlan
from kvreuse.sched.config import SchedulerConfig
from kvreuse.sched.fit import peak_blocks


@dataclass(eq=False, slots=True)
class Seq:
    """The scheduler's view of one request."""

    request: Request
    max_tokens: int
    prompt_len: int
    num_tokens: int  # N: prompt plus generated tokens
    output: list[int] = field(default_factory=list)
    scheduled: int = 0  # tokens scheduled in the current admission
    running: bool = False
    preemptions: int = 0
    deferred_steps: int = 0
    cached_tokens: int | None = None
    sampling: Any = None  # the engine's per-request sampling parameters (opaque here)
    stop_token_ids: frozenset[int] = frozenset()
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "too_large"
    stats: RequestStats | None = None  # the core's final statistics, kept at finish
    finished: bool = False
    too_large: bool = False  # can never fit the pool, even alone: rejected when reached
    request_id: str = field(init=False)  # the request's id, read several times per step

    def __post_init__(self) -> None:
        self.request_id = self.request.request_id


# The engine runs a sealed step and returns one outcome per `StepPlan.requests` entry, in that
# order (the core's `commit_batch`); a mapping from request id to outcome is accepted too. An
# outcome of None: the request did not run, because its tier loads failed and the engine told
# the core (`KVCacheManager.tier_faults`), which sends it back to wait; so does the scheduler.
Outcomes = Sequence[tuple[Any, ...] | None] | Mapping[str, tuple[Any, ...] | None]
Engine = Callable[[StepPlan, Mapping[str, "Seq"]], Outcomes]


@dataclass(slots=True)
class StepStats:
    step_id: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    admitted: list[str]
    preempted: list[str]
    deferred: list[str]
    finished: list[str]
    rejected: list[str] = field(default_factory=list)  # can never fit the pool: finished
    # blocks referenced once the step's allocations are done: the step's peak, since the
    # commit and the finishes that follow only release blocks
    num_used_blocks: int = 0
    first_output: list[str] = field(default_factory=list)  # their first token came this step


class Scheduler:
    """FCFS continuous batching with chunked prefill, preemption by recompute and deferral."""

    def __init__(
        self, mgr: KVCacheManager, engine: Engine, config: SchedulerConfig | None = None
    ) -> None:
        self.mgr = mgr
        self.engine = engine
        self.config = config or SchedulerConfig()
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # in admission order: the last is the preemption victim
        self.seqs: dict[str, Seq] = {}
        self.num_steps = 0
        # a store shared with other processes: each step and abort is one turn over it
        # (kvreuse.serve.store_turns); None: no such tier
        self.turn: Callable[[], AbstractContextManager[None]] | None = None
        self._usable_blocks = mgr.config.num_blocks - 1  # the null block is never handed out

    # ------------------------------------------------------------------ requests
    def add(
        self,
        request: Request,
        max_tokens: int,
        sampling: Any = None,
        stop_token_ids: Collection[int] = (),
    ) -> Seq:
        """Queue a request; `sampling` is handed to the engine untouched (as `seq.sampling`).

        The request finishes after `max_tokens` generated tokens, or right after the first
        generated token in `stop_token_ids` (that token is kept in `output`)."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int ≥ 1, got {max_tokens!r}")
        self.mgr.add_request(request)
        num = len(request.prompt_token_ids)
        seq = Seq(request, max_tokens, num, num, sampling=sampling)
        seq.stop_token_ids = frozenset(stop_token_ids)
        seq.too_large = self.peak_blocks(num, max_tokens) > self._usable_blocks
        self.seqs[seq.request_id] = seq
        self.waiting.append(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.seqs[request_id]
        if seq.finished:
            return  # already finished (or aborted): nothing to free
        if self.turn is not None:
            with self.turn():  # a hybrid's finish may write its state through to the store
                seq.stats = self.mgr.finish(request_id)
                self.hand_tier_ops()  # within the turn: the slots they name are this turn's
        else:
            seq.stats = self.mgr.finish(request_id)
        seq.finish_reason = "abort"
        self._drop(seq)

    def pop_finished(self, request_id: str) -> Seq:
        """Hand over a finished request's `Seq` and forget it (a long run keeps no history)."""
        seq = self.seqs[request_id]
        if not seq.finished:
            raise ValueError(f"pop_finished: request {request_id!r} has not finished")
        return self.seqs.pop(request_id)

    def peak_blocks(self, num_prompt: int, max_tokens: int) -> int:
        """The most blocks such a request holds at once, alone in this pool (kvreuse.sched.fit):
        one more than `num_usable_blocks` and it is refused."""
        return peak_blocks(self.mgr.config.geometry, self.config, num_prompt, max_tokens)

    @property
    def num_usable_blocks(self) -> int:
        """The pool's blocks a request can hold (the null block is never handed out)."""
        return self._usable_blocks

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ the step
    def step(self) -> StepStats:
        if self.turn is None:
            return self._step()
        with self.turn():
            return self._step()

    def _step(self) -> StepStats:
        stats = StepStats(0, 0, 0, 0, [], [], [], [])
        budget = self._grow_running(stats, self.config.max_num_batched_tokens)
        self.admit_waiting(stats, budget)
        stats.num_used_blocks = self._usable_blocks - self.mgr.num_free_blocks
        step = self.mgr.seal_step()
        stats.step_id = step.step_id
        if step.requests:
            outcomes = self.engine(step, self.seqs)
            if isinstance(outcomes, Mapping):
                self.mgr.commit(step.step_id, outcomes)
                outcomes = [outcomes[p.request_id] for p in step.requests]
            else:
                self.mgr.commit_batch(step.step_id, outcomes)
            self._apply(step, outcomes, stats)
        elif step.tier_ops:  # nothing to compute, but copies decided since the last step
            self.hand_tier_ops(step)
        self._finish_done(stats)
        if self.mgr.tiers.writes_through:
            self.hand_tier_ops()
        self.num_steps += 1
        return stats

    # ------------------------------------------------------------------ parts of a step
    def hand_tier_ops(self, step: StepPlan | None = None) -> None:
        """Tier ops outside a forward: a plan's with no request (`step`), or the write-through
        copies of what this step's commit and finishes published, so that a tier shared with
        other replicas is free when the step ends. An engine without `run_tier_ops` gets a
        plan's as a step, and the copies with the next step's plan."""
        run = getattr(self.engine, "run_tier_ops", None)
        if run is None:
            if step is not None:
                self.engine(step, self.seqs)
            return
        ops = step.tier_ops if step is not None else self.mgr.take_tier_ops()
        if ops:
            run(ops)

    def _grow_running(self, stats: StepStats, budget: int) -> int:
        """Decode first (latency), then prefill chunks; preempt the newest on OOM."""
        decoders: list[Seq] = []
        prefilling: list[Seq] = []
        for s in self.running:
            (decoders if s.scheduled >= s.num_tokens - 1 else prefilling).append(s)
        budget = self._grow_decoders(stats, decoders, budget)
        for seq in prefilling:
            if budget <= 0 or not seq.running:  # preempted earlier in this step
                continue
            num_new = self._num_new(seq, seq.scheduled, budget)
            if self._grow(seq, num_new, stats):
                budget -= num_new
        return budget

    def _grow_decoders(self, stats: StepStats, decoders: list[Seq], budget: int) -> int:
        """One token plus the drafts to verify for each decoding request, in order, while the
        budget lasts: grown with one `allocate_many` call up to the first that does not fit,
        which preempts as `_grow` does before the rest go on."""
        decode = 1 + self.config.num_spec_tokens
        i = 0
        while i < len(decoders) and budget >= decode:
            first, room = i, budget // decode
            if not stats.preempted:  # nothing preempted yet in this step: all of them run
                batch = decoders[i : i + room]
                i += len(batch)
            else:
                batch = []
                while i < len(decoders) and len(batch) < room:
                    seq = decoders[i]
                    i += 1
                    if seq.running:  # else preempted earlier in this step
                        batch.append(seq)
            plans = self.mgr.allocate_many(
                [s.request_id for s in batch], decode, stop_when_full=True
            )
            for seq in batch[: len(plans)]:  # _count, inlined: a decode step of each
                seq.scheduled += decode
                if seq.output:
                    stats.num_decode_tokens += decode
                else:  # the last prompt token of a warm hit: prefill (see _count)
                    stats.num_prefill_tokens += decode
            stats.num_scheduled_tokens += decode * len(plans)
            budget -= decode * len(plans)
            if len(plans) < len(batch):  # the pool is full: preempt for this one
                seq = batch[len(plans)]
                i = decoders.index(seq, first) + 1  # the rest form the next batch
                if self._grow(seq, decode, stats):
                    budget -= decode
        return budget

    def _grow(self, seq: Seq, num_new: int, stats: StepStats) -> bool:
        """Grow `seq` by `num_new`, preempting the newest running request until it fits; False
        when `seq` itself was preempted (or, alone in the batch, rejected)."""
        while self.mgr.allocate(seq.request_id, num_new) is None:
            victim = self.running[-1]
            self._preempt(victim, stats)
            if victim is seq:
                if not self.running:  # it had the whole pool and still did not fit
                    self.waiting.popleft()  # where _preempt put it
                    self._reject(seq, stats)
                return False
        self._count(stats, seq, seq.scheduled, num_new)
        seq.scheduled += num_new
        return True

    def admit_waiting(self, stats: StepStats, budget: int) -> None:
        """Admit waiting requests, FCFS, within `budget` and the seats left (a step's last part)."""
        waiting = self.waiting
        skipped: list[Seq] = []  # deferred this step: they keep their place at the front
        # A deferred request keeps its seat in the batch: counting it against max_num_seqs
        # bounds the scan (a burst would otherwise look up the whole queue every step).
        seats = self.config.max_num_seqs - len(self.running)
        while waiting and budget > 0 and seats > 0:
            seq = waiting.popleft()
            if seq.too_large:  # refused up front: running it would only preempt itself
                self._reject(seq, stats)
                seats -= 1  # a refusal takes a seat too: a flood of them cannot stall a step
                continue
            res = self.mgr.lookup(seq.request_id)
            if (
                self.config.defer_shared_prefix
                # another request is computing more of this prefix: its state (pending_hit) or,
                # on a hybrid, the attention that reveals where the state must be saved (D15)
                and (res.pending_hit > res.hit or res.pending_bounds[2] > res.bounds[2])
                and seq.deferred_steps < self.config.max_defer_steps
            ):
                seq.deferred_steps += 1  # another request is computing this prefix right now
                stats.deferred.append(seq.request_id)
                skipped.append(seq)
                seats -= 1
                continue
            num_new = self._num_new(seq, res.hit, budget, lookup=res)
            if self.mgr.allocate(seq.request_id, num_new, lookup=res) is None:
                if not self.running:  # the whole pool is free for it, and it still won't fit
                    self._reject(seq, stats)
                    seats -= 1
                    continue
                waiting.appendleft(seq)  # FCFS: nothing behind it may jump the queue
                break
            if seq.cached_tokens is None:
                seq.cached_tokens = res.hit
            seq.running, seq.scheduled = True, res.hit + num_new
            self.running.append(seq)
            seats -= 1
            stats.admitted.append(seq.request_id)
            self._count(stats, seq, res.hit, num_new)
            budget -= num_new
        waiting.extendleft(reversed(skipped))  # O(deferred), not O(queue)

    def chunk_size(self, seq: Seq, budget: int) -> int:
        """The prefill tokens a running request's next chunk takes within `budget` (> 0)."""
        return self._num_new(seq, seq.scheduled, budget)

    def _num_new(self, seq: Seq, start: int, budget: int, lookup: Any = None) -> int:
        """Prefill tokens to schedule from `start`: the rest of the prompt (and of any re-computed
        output), within the budget and ending at the next save position. (A decode step's size,
        one token plus the drafts to verify, is set in `_grow_running`.)"""
        n = min(seq.num_tokens - start, budget)
        if self.config.chunk_at_save_positions:
            nxt = self.mgr.next_save_position(seq.request_id, lookup)
            if nxt is not None and start < nxt < start + n:
                n = nxt - start  # the engine writes states at the end of a step (spec §9.7)
        return max(1, n)

    def _preempt(self, seq: Seq, stats: StepStats) -> None:
        self.mgr.preempt(seq.request_id)
        self._requeue(seq, stats)

    def _requeue(self, seq: Seq, stats: StepStats) -> None:
        self.running.remove(seq)
        seq.running, seq.scheduled = False, 0
        seq.preemptions += 1
        self.waiting.appendleft(seq)
        stats.preempted.append(seq.request_id)

    def _count(self, stats: StepStats, seq: Seq, start: int, num_new: int) -> None:
        stats.num_scheduled_tokens += num_new
        # the last prompt token of a request with no output yet (a warm hit that leaves one
        # token to compute) is prefill, not a decode step
        if start >= seq.num_tokens - 1 and seq.output:
            stats.num_decode_tokens += num_new
        else:
            stats.num_prefill_tokens += num_new

    def _reject(self, seq: Seq, stats: StepStats) -> None:
        """Finish a request that cannot fit even an empty pool (else: a hang): its whole
        length is known not to fit (`too_large`), its first chunk did not fit, or it preempted
        itself with nothing else running."""
        seq.stats = self.mgr.finish(seq.request_id)
        seq.finished, seq.finish_reason = True, "too_large"
        stats.rejected.append(seq.request_id)

    def _apply(
        self, step: StepPlan, outcomes: Sequence[tuple[Any, ...] | None], stats: StepStats
    ) -> None:
        seqs = self.seqs
        for plan, outcome in zip(step.requests, outcomes, strict=True):
            seq = seqs[plan.request_id]
            if outcome is None:  # its tier loads failed: the core sent it back to wait
                self._requeue(seq, stats)
                continue
            t_new, new_tokens = outcome[0], outcome[1]
            seq.scheduled = t_new  # rejected drafts are scheduled again
            if not new_tokens:
                continue  # a prefill chunk
            seq.num_tokens += len(new_tokens)
            output = seq.output
            if not output:
                stats.first_output.append(seq.request_id)
            if (  # most steps: one token, no stop tokens, and room left after it
                len(new_tokens) == 1
                and not seq.stop_token_ids
                and seq.finish_reason is None
                and len(output) + 1 < seq.max_tokens
            ):
                output.append(new_tokens[0])
                continue
            self.extend_output(seq, new_tokens)

    def extend_output(self, seq: Seq, new_tokens: Sequence[int]) -> None:
        """Append a step's new tokens to `seq.output`, up to where the request ends (max_tokens
        or a stop token, kept), and mark it finished there."""
        # Accepted drafts may run past max_tokens or a stop token: the core keeps them (their
        # KV is valid), the output ends where the request does.
        room = seq.max_tokens - len(seq.output)
        new = new_tokens[:room]
        if seq.stop_token_ids:
            stop = next((i for i, t in enumerate(new) if t in seq.stop_token_ids), None)
            if stop is not None:
                new, seq.finish_reason = new[: stop + 1], "stop"
        seq.output.extend(new)
        if seq.finish_reason is None and len(seq.output) >= seq.max_tokens:
            seq.finish_reason = "length"
        seq.finished = seq.finish_reason is not None

    def _finish_done(self, stats: StepStats) -> None:
        for seq in [s for s in self.running if s.finished]:
            self.finish_running(seq, stats)

    def finish_running(self, seq: Seq, stats: StepStats) -> None:
        """Release a running request that reached its end in this step (`seq.finished`)."""
        seq.stats = self.mgr.finish(seq.request_id)
        self._drop(seq)
        stats.finished.append(seq.request_id)

    def _drop(self, seq: Seq) -> None:
        if seq.running:
            self.running.remove(seq)
        elif not seq.finished:
            self.waiting.remove(seq)  # an abort of a waiting request
        seq.running = False
        seq.finished = True
