"""`kvreuse.sched`: a continuous-batching scheduler over the core, and scripted engines for
simulation and tests."""

from kvreuse.sched.advance import FastForward
from kvreuse.sched.config import SchedulerConfig
from kvreuse.sched.engine import (
    DRAFT_ACCEPT_RATE,
    POSITIONAL_PERIOD,
    ContentTokens,
    DecodeScript,
    FakeEngine,
    PositionalTokens,
    ReplayTokens,
    ScriptedEngine,
    TokenSource,
    token_at,
)
from kvreuse.sched.fit import peak_blocks
from kvreuse.sched.scheduler import Engine, Scheduler, Seq, StepStats

__all__ = [
    "DRAFT_ACCEPT_RATE",
    "POSITIONAL_PERIOD",
    "ContentTokens",
    "DecodeScript",
    "Engine",
    "FakeEngine",
    "FastForward",
    "PositionalTokens",
    "ReplayTokens",
    "Scheduler",
    "SchedulerConfig",
    "ScriptedEngine",
    "Seq",
    "StepStats",
    "TokenSource",
    "peak_blocks",
    "token_at",
]
