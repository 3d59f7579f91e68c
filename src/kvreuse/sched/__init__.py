"""`kvreuse.sched`: a continuous-batching scheduler over the core, and a fake engine."""

from kvreuse.sched.engine import FakeEngine, token_at
from kvreuse.sched.scheduler import Scheduler, SchedulerConfig, Seq, StepStats

__all__ = ["FakeEngine", "Scheduler", "SchedulerConfig", "Seq", "StepStats", "token_at"]
