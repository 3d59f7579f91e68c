"""`kvreuse.sched`: a continuous-batching scheduler over the core, and scripted engines for
simulation and tests."""

from kvreuse.sched.engine import (
    ContentTokens,
    FakeEngine,
    PositionalTokens,
    ReplayTokens,
    ScriptedEngine,
    TokenSource,
    token_at,
)
from kvreuse.sched.scheduler import Engine, Scheduler, SchedulerConfig, Seq, StepStats

__all__ = [
    "ContentTokens",
    "Engine",
    "FakeEngine",
    "PositionalTokens",
    "ReplayTokens",
    "Scheduler",
    "SchedulerConfig",
    "ScriptedEngine",
    "Seq",
    "StepStats",
    "TokenSource",
    "token_at",
]
