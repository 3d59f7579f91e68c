"""`kvreuse.sim`: workload files and generators (the simulator itself is still to come)."""

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
