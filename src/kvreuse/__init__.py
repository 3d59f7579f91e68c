"""kvreuse: exact prefix-cache reuse for LLM serving.

The core (`kvreuse.core`) is pure Python and is re-exported here; the oracle (`kvreuse.oracle`)
is the slow reference model the core is tested against.
"""

from kvreuse.core import *  # noqa: F403
from kvreuse.core import __all__ as _core_all

__version__ = "0.1.0"
__all__ = [*_core_all, "__version__"]

_ENGINE_NAMES = ("LLM", "SamplingParams")


def __getattr__(name: str) -> object:
    """`kvreuse.LLM` / `kvreuse.SamplingParams`, imported on first use: importing kvreuse itself
    must not import torch. (Not in `__all__`, so `from kvreuse import *` stays torch-free.)"""
    if name in _ENGINE_NAMES:
        import kvreuse.engine

        return getattr(kvreuse.engine, name)
    raise AttributeError(f"module 'kvreuse' has no attribute {name!r}")
