"""`kvreuse.sim`: workload files and generators, and the simulator that replays a workload on a
deployment through the scheduler and the core (`kvreuse.sim.run.simulate`, `kvreuse simulate`)."""

from kvreuse.sim.generators import GENERATORS
from kvreuse.sim.workload import (
    WorkloadError,
    WorkloadRequest,
    load_workload,
    random_tokens,
    resolve_prompt,
)

__all__ = [
    "GENERATORS",
    "WorkloadError",
    "WorkloadRequest",
    "load_workload",
    "random_tokens",
    "resolve_prompt",
]
