"""What a simulated step costs: an estimate for one server, set in a geometry's [cost] table.

    step time = prefill tokens / prefill_tokens_per_s
              + saved recurrent states × saved_state_s
              + prefill chunks × prefill_chunk_s
              + decode_step_s                       (when the step decodes)

A saved state is one recurrent state the engine writes (per recurrent group and position), so
a geometry that checkpoints every 256 tokens pays for eight times the states of one that
checkpoints every 2,048; a prefill chunk is one request's share of a step that prefills it.
`CostMeter` wraps the simulator's engine to count both per step, from the step's plans and
the outcomes the engine returns for the core's commit. `fit_state_cost` solves a throughput and
a per-state cost from two measured cold prefills (docs/simulate.md, "The cost model").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from kvreuse.core import KVCacheManager, Request, StepPlan, TierOp, TierSpec
from kvreuse.deployment import COST_LIMITS, Deployment, DeploymentSpec, cost_problem, resolve
from kvreuse.sched import DecodeScript, Engine, FakeEngine, Scheduler, Seq
from kvreuse.tiering import HOST_TIER


@dataclass(frozen=True, slots=True)
class CostModel:
    """An estimate, not a measurement (the defaults are no particular server's)."""

    prefill_tokens_per_s: float = 20_000.0
    decode_step_s: float = 0.02
    saved_state_s: float = 0.0
    prefill_chunk_s: float = 0.0
    # loads from the tiers below the pool: 10× and 2.5× the default prefill rate, plus a
    # latency per step that loads (a state counts as one page of its group's tokens)
    host_tokens_per_s: float = 200_000.0
    host_step_s: float = 0.0005
    store_tokens_per_s: float = 50_000.0
    store_step_s: float = 0.002

    def __post_init__(self) -> None:
        for f in fields(self):
            problem = cost_problem(f.name, getattr(self, f.name))
            if problem is not None:
                raise ValueError(f"cost model: {problem}")

    @classmethod
    def for_deployment(cls, dep: Deployment, **overrides: float | None) -> CostModel:
        """The deployment's [cost], every key it leaves out at its default, and `overrides`
        that are not None on top (a command line's explicit options)."""
        unknown = sorted(set(overrides) - set(COST_LIMITS))
        if unknown:
            raise TypeError(f"unknown cost field(s) {unknown}; fields: {sorted(COST_LIMITS)}")
        given = {k: v for k, v in overrides.items() if v is not None}
        return cls(**{**dep.cost, **given})

    def tier_rate(self, spec: TierSpec) -> tuple[float, float]:
        """(tokens per second, seconds per step that loads) of a tier: the host's rates for
        the host's tier, the store's for any other."""
        if spec.name == HOST_TIER:
            return self.host_tokens_per_s, self.host_step_s
        return self.store_tokens_per_s, self.store_step_s

    def prefill_time(
        self, num_prefill_tokens: int, num_saved_states: int = 0, num_prefill_chunks: int = 0
    ) -> float:
        return (
            num_prefill_tokens / self.prefill_tokens_per_s
            + num_saved_states * self.saved_state_s
            + num_prefill_chunks * self.prefill_chunk_s
        )

    def step_time(
        self,
        num_prefill: int,
        num_decode: int,
        num_saved_states: int = 0,
        num_prefill_chunks: int = 0,
    ) -> float:
        decode = self.decode_step_s if num_decode else 0.0
        return self.prefill_time(num_prefill, num_saved_states, num_prefill_chunks) + decode


Outcomes = Any  # a list of outcome tuples in plan order, or a mapping by request id


class CostMeter:
    """The simulator's engine with a meter: it runs each step through `engine` unchanged and
    counts the recurrent states the engine reports saved (the third field of an outcome, what
    the core's commit publishes or holds) and the prefill chunks of the step.

    `step_time(num_prefill, num_decode)` is then the cost of the step just run (the token
    counts come from the scheduler's `StepStats`); it also adds the step to the run's totals
    (`summary()`). A step with no request never reaches the engine and costs its tokens only.
    """

    def __init__(self, engine: Engine, cost: CostModel, mgr: KVCacheManager | None = None) -> None:
        self.engine, self.cost = engine, cost
        self.num_saved_states = 0  # the run's totals
        self.num_prefill_chunks = 0
        self.prefill_seconds = 0.0
        self._saved = self._chunks = 0  # the step in flight
        self.loads = TierLoadMeter(mgr, cost) if mgr is not None and mgr.tiers else None

    def run_tier_ops(self, ops: Sequence[TierOp]) -> None:
        """A commit's write-through copies: the simulator moves no bytes, and a copy out of the
        device overlaps compute, as a demotion does (free in the cost model)."""

    def __call__(self, step: StepPlan, seqs: Mapping[str, Seq]) -> Outcomes:
        outcomes = self.engine(step, seqs)
        values = outcomes.values() if isinstance(outcomes, Mapping) else outcomes
        saved = 0
        for outcome in values:
            if outcome is not None and len(outcome) > 2 and outcome[2]:
                saved += len(outcome[2])
        chunks = 0
        for plan in step.requests:
            seq = seqs[plan.request_id]
            # the scheduler's rule: a plan is prefill unless the request already has output
            # and the plan starts at its last token (a decode step)
            if plan.start < seq.num_tokens - 1 or not seq.output:
                chunks += 1
        self._saved += saved
        self._chunks += chunks
        return outcomes

    def decode_script(self) -> _MeteredScript | None:
        """The wrapped engine's decode script (`kvreuse.sched.engine`), counting what the
        steps it stands for save, as `__call__` counts what a step run through it saves."""
        inner = getattr(self.engine, "decode_script", None)
        script = inner() if inner is not None else None
        return None if script is None else _MeteredScript(script, self)

    def step_time(self, num_prefill: int, num_decode: int) -> float:
        saved, chunks = self._saved, self._chunks
        self._saved = self._chunks = 0
        prefill = self.cost.prefill_time(num_prefill, saved, chunks)
        self.num_saved_states += saved
        self.num_prefill_chunks += chunks
        self.prefill_seconds += prefill
        load = self.loads.step() if self.loads is not None else 0.0
        return prefill + load + (self.cost.decode_step_s if num_decode else 0.0)

    def summary(self) -> dict[str, Any]:
        """The run's totals, for its summary: states saved, prefill chunks, and the seconds the
        cost model spent on prefill (every step's time but its decode step)."""
        out: dict[str, Any] = {
            "saved_states": self.num_saved_states,
            "prefill_chunks": self.num_prefill_chunks,
            "prefill_seconds": round(self.prefill_seconds, 6),
        }
        if self.loads is not None:
            out["tiers"] = self.loads.summary()
        return out


class TierLoadMeter:
    """The time of each step's loads from the tiers below the pool: per tier, the tokens its
    loads carry (an attention block its page, a state one page of its group) over the tier's
    rate, plus the tier's latency when the step loads from it. Read from the manager's own
    counts after each step, so both paths of the simulator meter the same loads."""

    def __init__(self, mgr: KVCacheManager, cost: CostModel) -> None:
        self.stack = mgr.tiers
        self.pages = [g.page_size for g in mgr.geo.groups]
        self.rates = [cost.tier_rate(t.spec) for t in self.stack.tiers]
        self.seen = [list(row) for row in self.stack.num_loaded]
        self.seconds = [0.0] * len(self.rates)

    def step(self) -> float:
        total = 0.0
        for t, row in enumerate(self.stack.num_loaded):
            if row == self.seen[t]:
                continue
            tokens = sum((n - m) * p for n, m, p in zip(row, self.seen[t], self.pages, strict=True))
            rate, latency = self.rates[t]
            dt = tokens / rate + latency
            self.seconds[t] += dt
            total += dt
            self.seen[t] = list(row)
        return total

    def summary(self) -> dict[str, Any]:
        stack, out = self.stack, {}
        for t, tier in enumerate(stack.tiers):
            row = stack.num_loaded[t]
            out[tier.spec.name] = {
                "capacity_blocks": tier.spec.num_blocks,
                "held_blocks": len(tier),
                "loaded_blocks": sum(row),
                "hit_tokens": stack.hit_tokens[t],  # of first admissions, as `hits` counts
                "load_seconds": round(self.seconds[t], 6),
            }
        return {
            **out,
            "demoted_blocks": stack.num_demoted,
            "dropped_blocks": stack.num_dropped,
        }


class _MeteredScript:
    """A decode script whose steps the meter counts (saved states, prefill chunks)."""

    def __init__(self, script: DecodeScript, meter: CostMeter) -> None:
        self.script, self.meter = script, meter
        self.saves = script.saves
        self.accepted = script.accepted
        self.token_run = script.token_run

    def record(
        self, num_forward_tokens: int, num_saved_states: int, num_prefill_chunks: int = 0
    ) -> None:
        self.script.record(num_forward_tokens, num_saved_states, num_prefill_chunks)
        self.meter._saved += num_saved_states
        self.meter._chunks += num_prefill_chunks


@dataclass(frozen=True, slots=True)
class ColdPrefill:
    """One cold prompt alone on a deployment: what its prefill costs and why."""

    prompt_tokens: int
    seconds: float  # the cost model's time to the first token
    num_saved_states: int
    num_prefill_chunks: int

    @property
    def tokens_per_s(self) -> float:
        return self.prompt_tokens / self.seconds


def cold_prefill(
    spec: DeploymentSpec, prompt_tokens: int, cost: CostModel | None = None
) -> ColdPrefill:
    """Run one `prompt_tokens`-token prompt (one output token) through the scheduler and the
    core on an empty cache: the states it saves follow the core's save-position rules, and
    the chunks the scheduler's (each ends at the next save position)."""
    dep = resolve(spec)
    meter = CostMeter(FakeEngine(), cost or CostModel.for_deployment(dep))
    mgr = KVCacheManager(replace(dep.cache, enable_events=False))
    sched = Scheduler(mgr, meter, dep.sched)
    seq = sched.add(Request("cold", prompt_token_ids=list(range(prompt_tokens))), 1)
    seconds = 0.0
    while sched.has_work():
        st = sched.step()
        seconds += meter.step_time(st.num_prefill_tokens, st.num_decode_tokens)
    if seq.finish_reason == "too_large":
        raise ValueError(f"{dep.name}: a {prompt_tokens:,}-token prompt does not fit the pool")
    return ColdPrefill(prompt_tokens, seconds, meter.num_saved_states, meter.num_prefill_chunks)


def fit_state_cost(
    prompt_tokens: int,
    a: tuple[DeploymentSpec, float],
    b: tuple[DeploymentSpec, float],
    decode_step_s: float = 0.02,
) -> CostModel:
    """The prefill throughput and per-state cost that make two deployments' cold prefills of
    `prompt_tokens` tokens run at the measured tokens/s (a and b: a deployment and its
    measured rate; the same server, so one throughput and one cost per state for both).

    Each cold prefill takes prompt_tokens / rate + n × saved_state_s, with n the states that
    deployment saves (`cold_prefill`, counted with no cost): two equations, two unknowns."""
    counts = []
    for spec, measured in (a, b):
        if not measured > 0:
            raise ValueError(f"a measured throughput must be > 0 tokens/s, got {measured!r}")
        n = cold_prefill(spec, prompt_tokens, CostModel())  # the counts only
        counts.append((n.num_saved_states, prompt_tokens / measured))
    (n_a, t_a), (n_b, t_b) = counts
    if n_a == n_b:
        raise ValueError(
            f"both deployments save {n_a} states on a {prompt_tokens:,}-token prompt: their "
            "difference cannot tell a per-state cost (pick geometries that checkpoint differently)"
        )
    per_state = (t_b - t_a) / (n_b - n_a)
    base = t_a - n_a * per_state
    if per_state < 0 or base <= 0:
        raise ValueError(
            "the measurements do not fit 'tokens / rate + states × cost' with a rate > 0 and a "
            f"cost ≥ 0 (states {n_a} vs {n_b}, seconds {t_a:.4f} vs {t_b:.4f})"
        )
    return CostModel(prompt_tokens / base, decode_step_s, per_state)
