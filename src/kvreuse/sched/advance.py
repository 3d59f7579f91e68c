"""Fast-forward: a decoding batch advanced over the steps in which nothing can change.

Most steps of a simulation are decode steps in which every running request gains a token (or
its accepted drafts) and nothing else happens: no page is added, no save is owed, no entry is
published, no page leaves a window, nobody finishes, arrives, is admitted or preempted. Such a
*quiet* step changes only the request's own tokens and T, which nothing reads until that
request next does something. So its quiet steps need no call to the core: they are folded into
the request's next plan, which covers them and the step where something happens (its *event*)
and commits them as one outcome. The event steps themselves keep their places: the requests
with an event in step j are allocated, sealed and committed as step j, in the step's plan order
(running order), and finish after it, so every pool operation (pops and the evictions they
cause, publications, window frees, releases) happens in the same order as step by step.

    step          j0    j0+1  j0+2  j0+3  j0+4  j0+5
    request A     q     q     q     q     E     q        q: quiet, E: event
    request B     q     q     E     q     q     q
    core calls    -     -     B     -     A     -        B's plan covers j0 … j0+2, A's j0 … j0+4

A step from T that computes [T, T + 1 + s) (s drafts) and commits T′ ≤ T + 1 + s is an event of
its request when [T, T + 1 + s] holds a *mark*: a multiple of the hash unit or of any group's
page (a page is added when the step's end passes one; units are published, and rolling, dense
and planned saves sit, on unit boundaries), a position where the chain completes a unit
(T′ ≡ L − 1 mod u with L lookahead tokens: on a hybrid it moves the held states, with L ≥ 2 what
a commit publishes), or one where a commit may free a page (the group's `free_marks`: T′ ≡ W − 1
mod B for a sliding window); or when the request finishes in it (max_tokens, a stop token).
Marks may flag steps that turn out quiet; that costs a plan, never a difference. With drafts,
each step's acceptance is drawn from the engine's own generator for (request, position), the
same draw the step-by-step engine makes, so the trajectory of T is known ahead.

A request still prefilling (a chunk each step, sized by the scheduler's own rule) or computing
its last prompt token has an event in every step. A step that can admit runs the scheduler's
own admission after the step's growth (lookups, deferral, FCFS), as `Scheduler.step()` does:
the lookups see the same index and the same pending keys, since a quiet step would publish
nothing and its request has no plan in the step. A stretch lasts while every decoding request
fits the token budget and every plan of the step surely gets its pages (saves are best effort:
they only take blocks from the plans after them, `_fits`); before a step that might preempt,
every request is brought up to date with one plan of its quiet steps (`close`) and the
scheduler's own `step()` takes that step. `tests/sim/test_fast_forward.py`
holds both paths to identical rows, summaries, timelines and event streams.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

from kvreuse.sched.engine import DecodeScript
from kvreuse.sched.scheduler import Scheduler, Seq, StepStats

HORIZON = 64  # with drafts, steps drawn ahead of a request at a time (draws past a cut are lost)


@dataclass(eq=False, slots=True)
class _Lane:
    """One running request during a stretch: where the core has it, and where it is going."""

    seq: Seq
    rank: int  # its place in the running order
    base: int  # T the core has committed: the next plan starts here
    first: int  # the step at which it was at `base`
    path: list[int] | None  # with drafts or stop tokens: T at each step from `first` on
    event: int  # the step of its next event (or, with `ahead`, of drawing further)
    t_event: int  # T at the start of that step
    t_after: int  # T after it
    ahead: bool = False  # the event only extends `path`; nothing happens to the core there
    prefill: bool = False  # a chunk every step (synced each step: `base` and `path` unused)

    def t_at(self, step: int) -> int:
        """T at the start of `step` (first ≤ step ≤ event)."""
        if self.path is None:
            return self.base + step - self.first
        return self.path[step - self.first]


def marks(geometry: Any) -> list[tuple[int, int]]:
    """(modulus, residue) of every position near which a decode step may do more than append
    its tokens (the module docstring)."""
    u, lookahead = geometry.hash_unit, geometry.lookahead
    out = {(u, 0)}
    if geometry.recurrent or lookahead >= 2:  # else a unit completing changes nothing shared
        out.add((u, (lookahead - 1) % u))
    for g in geometry.groups:
        out.add((g.page_size, 0))
        out.update(g.free_marks())
    # a position ≡ r mod m is ≡ r mod m2 for every divisor m2 of m: keep the coarsest pairs
    return sorted(
        (m, r)
        for m, r in out
        if not any((m2, r2) != (m, r) and m % m2 == 0 and r % m2 == r2 for m2, r2 in out)
    )


class FastForward:
    """Steps of `sched` taken with core calls only where something happens (module docstring).

    `begin()` starts a stretch when the batch allows it; `step()` then takes one step at a time
    and returns its `StepStats` as `Scheduler.step()` would (None, after `close()`: that step
    needs the scheduler's own path). Between `begin()` and `close()` the scheduler's `Seq`s and
    the core lag behind the steps taken; nothing else may step, admit or finish meanwhile.
    """

    def __init__(self, sched: Scheduler, script: DecodeScript) -> None:
        self.sched, self.script = sched, script
        geo = sched.mgr.config.geometry
        self.decode = 1 + sched.config.num_spec_tokens
        self.marks = marks(geo)
        self.unit = geo.hash_unit
        self.save_groups = len(geo.recurrent) if geo.caching_enabled else 0
        self.at_end = script.saves == "at_end"
        # every running request by rank (insertion order is running order); a lane leaves
        # when its request finishes, so a long stretch holds no finished request
        self.lanes: dict[int, _Lane] = {}
        self.num_ranks = 0
        self.heap: list[tuple[int, int, _Lane]] = []  # decoding lanes by (event, rank)
        self.prefilling: list[_Lane] = []  # lanes with a prefill chunk to run, in rank order
        self.num_decoding = 0
        self.step_index = 0
        self.open = False

    # ------------------------------------------------------------------ stretches
    def begin(self) -> bool:
        """Start a stretch if the batch may be taken here: something runs and every decoding
        request fits the budget."""
        sched = self.sched
        running = sched.running
        if not running:
            return False
        decoding = sum(1 for s in running if s.scheduled >= s.num_tokens - 1)
        if self.decode * decoding > sched.config.max_num_batched_tokens:
            return False
        self.step_index, self.lanes, self.prefilling = 0, {}, []
        self.num_ranks = len(running)
        for rank, seq in enumerate(running):
            t = seq.num_tokens - 1
            lane = _Lane(seq, rank, t, 0, None, 0, t, t)
            self.lanes[rank] = lane
            if seq.scheduled >= t:
                self._arm(lane, 0)
            else:
                lane.prefill = True
                self.prefilling.append(lane)
        self.num_decoding = decoding
        lanes = self.lanes.values()
        self.heap = [(lane.event, lane.rank, lane) for lane in lanes if not lane.prefill]
        heapq.heapify(self.heap)
        self.open = True
        return True

    def _next_mark(self, t: int) -> int:
        """The first mark at or after position t."""
        return min(t + (r - t) % m for m, r in self.marks)

    def _arm(self, lane: _Lane, step: int) -> None:
        """Find the next event of a decoding lane from `step`, where the core has it at
        `lane.base`. A request with no output yet (its last prompt token) has it at once."""
        seq, d = lane.seq, self.decode
        t, lane.first = lane.base, step
        if not seq.output:
            n = 1 + (self.script.accepted(seq.request_id, t + 1, d - 1) if d > 1 else 0)
            lane.path, lane.ahead = None, False
            lane.event, lane.t_event, lane.t_after = step, t, t + n
        elif d == 1 and not seq.stop_token_ids:
            # one token a step: step i touches [t + i, t + i + 1]; the request finishes at the
            # step that brings its output to max_tokens
            i = min(max(0, self._next_mark(t) - 1 - t), seq.max_tokens - len(seq.output) - 1)
            lane.path = None
            lane.event, lane.t_event, lane.t_after, lane.ahead = step + i, t + i, t + i + 1, False
        else:
            lane.path = [t]
            self._draw(lane, len(seq.output))

    def _draw(self, lane: _Lane, output_len: int) -> None:
        """Extend `lane.path` step by step (the engine's draws) up to its next event, or by at
        most HORIZON steps (then `ahead`: drawing goes on at that step)."""
        seq, path, d = lane.seq, lane.path, self.decode
        assert path is not None
        rid, stops, accepted = seq.request_id, seq.stop_token_ids, self.script.accepted
        left = seq.max_tokens - output_len - (path[-1] - lane.base)  # each step emits T′ − T
        for _ in range(HORIZON):
            t = path[-1]
            n = 1 + (accepted(rid, t + 1, d - 1) if d > 1 else 0)
            done = n >= left
            if not done and stops:
                done = any(x in stops for x in self.script.token_run(rid, t + 1, t + 1 + n))
            if done or self._next_mark(t) <= t + d:
                lane.event = lane.first + len(path) - 1
                lane.t_event, lane.t_after, lane.ahead = t, t + n, False
                return
            path.append(t + n)
            left -= n
        lane.event, lane.t_event, lane.ahead = lane.first + len(path) - 1, path[-1], True

    # ------------------------------------------------------------------ one step
    def step(self) -> StepStats | None:
        """Take the next step of the stretch; None (after `close`) when it needs the
        scheduler's own step."""
        if not self.open:
            raise RuntimeError("FastForward.step: no stretch is open (call begin)")
        sched, d = self.sched, self.decode
        cfg = sched.config
        budget = cfg.max_num_batched_tokens - d * self.num_decoding
        if budget < 0 or not sched.running:
            self.close()  # a decoding request would not run this step, or nothing runs
            return None
        chunks: list[tuple[_Lane, int]] = []
        for lane in self.prefilling:
            if budget > 0:
                n = sched.chunk_size(lane.seq, budget)
                chunks.append((lane, n))
                budget -= n
        active = self._due()
        if not self._fits(active, chunks):
            self.close()  # the step might preempt
            return None
        n_dec = self.num_decoding
        fresh = sum(1 for lane in active if not lane.seq.output)  # a last prompt token each
        prefill = d * fresh + sum(n for _, n in chunks)
        decode = d * (n_dec - fresh)
        stats = StepStats(0, decode + prefill, prefill, decode, [], [], [], [])
        mgr = sched.mgr
        lanes = [*active, *(lane for lane, _ in chunks)]
        if lanes:
            ids = [lane.seq.request_id for lane in lanes]
            counts = [lane.t_event + d - lane.base for lane in active] + [n for _, n in chunks]
            plans = mgr.allocate_many(ids, counts)
            if None in plans:
                raise RuntimeError("fast-forward: a plan did not fit, though counted to fit")
        seats = len(sched.running)
        if sched.waiting and budget > 0 and cfg.max_num_seqs > seats:
            sched.admit_waiting(stats, budget)  # the scheduler's own rule, lookups and all
            for seq in sched.running[seats:]:
                lane = _Lane(seq, self.num_ranks, 0, 0, None, 0, 0, 0, prefill=True)
                self.lanes[lane.rank] = lane
                self.num_ranks += 1
                lanes.append(lane)
                self.prefilling.append(lane)
        stats.num_used_blocks = sched.num_usable_blocks - mgr.num_free_blocks
        saved = num_chunks = 0
        if lanes:
            saved, num_chunks = self._run(lanes, stats)
        self.script.record(stats.num_scheduled_tokens, saved, num_chunks)
        if mgr.tiers.writes_through:  # as the scheduler's step ends: a shared tier is free
            sched.hand_tier_ops()
        sched.num_steps += 1
        self.step_index += 1
        return stats

    def num_running_tokens(self) -> int:
        """Σ num_tokens of the running requests as `Scheduler.step()` would have left them:
        during a stretch the `Seq`s of decoding requests lag behind the steps taken."""
        if not self.open:
            return sum(s.num_tokens for s in self.sched.running)
        k = self.step_index
        return sum(
            lane.seq.num_tokens if lane.prefill else lane.t_at(k) + 1
            for lane in self.lanes.values()
        )

    def quiet_steps(self) -> int:
        """How many of the next steps surely do nothing but decode (no event is due, no chunk
        runs, nothing can be admitted): `skip` may take them at once."""
        sched = self.sched
        if self.prefilling or not self.num_decoding or not self.heap or not self.open:
            return 0
        cfg = sched.config
        budget = cfg.max_num_batched_tokens - self.decode * self.num_decoding
        if budget < 0 or (sched.waiting and budget > 0 and cfg.max_num_seqs > len(sched.running)):
            return 0
        return self.heap[0][0] - self.step_index

    @property
    def num_decode_tokens(self) -> int:
        """The decode tokens of a quiet step (each decoding request's token and drafts)."""
        return self.decode * self.num_decoding

    def skip(self, num_steps: int) -> None:
        """Take `num_steps` quiet steps (at most `quiet_steps()`): nothing but their count and
        the engine's forward tokens changes; the caller advances its clock for each."""
        if not 0 <= num_steps <= self.quiet_steps():
            raise ValueError(f"skip: {num_steps} steps, but {self.quiet_steps()} are quiet")
        self.script.record(self.num_decode_tokens * num_steps, 0, 0)
        self.sched.num_steps += num_steps
        self.step_index += num_steps

    def _due(self) -> list[_Lane]:
        """The decoding lanes with an event in this step, in rank order."""
        k, heap = self.step_index, self.heap
        active: list[_Lane] = []
        while heap and heap[0][0] == k:
            lane = heapq.heappop(heap)[2]
            if lane.ahead:
                self._draw(lane, len(lane.seq.output))
                if lane.event > k or lane.ahead:
                    heapq.heappush(heap, (lane.event, lane.rank, lane))
                    continue
            active.append(lane)
        if len(active) > 1:
            active.sort(key=lambda lane: lane.rank)
        return active

    def _fits(self, active: list[_Lane], chunks: list[tuple[_Lane, int]]) -> bool:
        """No plan of the step can fail, so it preempts nobody: in plan order, each plan's fresh
        pages fit what the plans before it left, their saves counted as taken (the core skips
        a save when the pool is dry, so a save never fails its own plan)."""
        mgr, d, u, groups = self.sched.mgr, self.decode, self.unit, self.save_groups
        left = mgr.num_free_blocks
        asks = [(lane.seq, lane.base, lane.t_event + d) for lane in active]
        asks += [(lane.seq, lane.seq.scheduled, lane.seq.scheduled + n) for lane, n in chunks]
        for seq, start, end in asks:
            pages = mgr.blocks_needed(seq.request_id, end - start)
            if pages > left:
                return False
            left -= pages
            if groups:  # a save per group and unit boundary in (start, end], at most
                left -= min(left, groups * (end // u - start // u))
        return True

    def _run(self, lanes: list[_Lane], stats: StepStats) -> tuple[int, int]:
        """Seal the step (its plans are `lanes`' in order: decoding events, prefill chunks,
        admissions), make the engine's outcomes, commit, settle. Returns the states the
        engine reports saved and the plans the cost model counts as prefill chunks."""
        mgr = self.sched.mgr
        step = mgr.seal_step()
        stats.step_id = step.step_id
        num_saved = num_chunks = 0
        token_run, at_end = self.script.token_run, self.at_end
        outcomes: list[tuple[int, list[int], list[int]]] = []
        for lane, plan in zip(lanes, step.requests, strict=True):
            seq = lane.seq
            num = seq.num_tokens
            # a prefill chunk samples a token only when it reaches the last one
            t_new = min(plan.start + plan.num_new_tokens, num) if lane.prefill else lane.t_after
            if plan.start < num - 1 or not seq.output:  # the cost meter's rule
                num_chunks += 1
            saved: list[int] = []
            if plan.saves:
                saved = [
                    s.position
                    for s in plan.saves
                    if (s.position == t_new if at_end else s.position <= t_new)
                ]
                num_saved += len(saved)
            outcomes.append((t_new, token_run(seq.request_id, num, t_new + 1), saved))
        mgr.commit_batch(step.step_id, outcomes)
        self._settle(lanes, outcomes, stats)
        return num_saved, num_chunks

    def _settle(
        self, lanes: list[_Lane], outcomes: list[tuple[int, list[int], list[int]]], stats: StepStats
    ) -> None:
        """The step's outcomes on the requests: tokens, first outputs, finishes in running
        order; lanes that now decode find their next event."""
        sched, nxt = self.sched, self.step_index + 1
        done: list[_Lane] = []
        for lane, (t_new, tokens, _) in zip(lanes, outcomes, strict=True):
            seq = lane.seq
            seq.scheduled = t_new
            if tokens:
                if not seq.output:
                    stats.first_output.append(seq.request_id)
                seq.num_tokens += len(tokens)
                sched.extend_output(seq, tokens)
                if seq.finished:
                    done.append(lane)
                    continue
            if lane.prefill:
                if t_new < seq.num_tokens - 1:
                    continue  # more prompt to prefill
                lane.prefill = False  # it decodes from the next step on
                self.prefilling.remove(lane)
                self.num_decoding += 1
            lane.base = t_new
            self._arm(lane, nxt)
            heapq.heappush(self.heap, (lane.event, lane.rank, lane))
        if done:
            done.sort(key=lambda lane: lane.rank)
            for lane in done:
                if lane.prefill:
                    self.prefilling.remove(lane)
                else:
                    self.num_decoding -= 1
                del self.lanes[lane.rank]
                sched.finish_running(lane.seq, stats)

    # ------------------------------------------------------------------ up to date
    def close(self) -> None:
        """Bring every request up to date: one plan each of its quiet steps since its last
        plan, committed as one core step (nothing in them touches the pool)."""
        if not self.open:
            return
        self.open = False
        k, mgr = self.step_index, self.sched.mgr
        behind = []
        for lane in self.lanes.values():
            if lane.seq.finished or lane.prefill:
                continue
            t = lane.t_at(k)
            if t != lane.base:
                behind.append((lane, t))
        self.lanes, self.heap, self.prefilling = {}, [], []
        if not behind:
            return
        ids = [lane.seq.request_id for lane, _ in behind]
        plans = mgr.allocate_many(ids, [t - lane.base for lane, t in behind])
        for plan in plans:
            if plan is None or plan.saves or any(plan.new_blocks.values()):
                raise RuntimeError("fast-forward: a catch-up of quiet steps needed the pool")
        step = mgr.seal_step()
        token_run = self.script.token_run
        outcomes: list[tuple[int, list[int], list[int]]] = [
            (t, token_run(lane.seq.request_id, lane.base + 1, t + 1), []) for lane, t in behind
        ]
        mgr.commit_batch(step.step_id, outcomes)
        for (lane, t), (_, tokens, _) in zip(behind, outcomes, strict=True):
            seq = lane.seq
            seq.num_tokens += len(tokens)
            seq.scheduled = t
            seq.output.extend(tokens)  # quiet steps end nothing: max_tokens lies further on
