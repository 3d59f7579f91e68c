"""kvreuse: exact prefix-cache reuse for LLM serving.

Engine builders: the core (`kvreuse.core`), pure Python, re-exported here. `KVCacheManager`,
configured by `CacheConfig` and its `GroupSpec`s, takes `Request`s and answers with a
`LookupResult`, `RequestPlan`s sealed into a `StepPlan` (its `Copy`s, `Save`s and
`RecurrentSlot`s), `RequestStats` at finish, events (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`) and errors (`ConfigError`, `StaleLookupError`, `UnknownRequestError`,
`InvariantError`).

Operators: the command line (`kvreuse serve | qualify | simulate | workload | demo`, in
`kvreuse.cli`) and what it runs with, a deployment (`kvreuse.deployment`: presets and TOML
geometry files). `LLM` and `SamplingParams` are the embedded PyTorch engine's offline API,
loaded on first use: `import kvreuse` does not import torch.

Researchers: `EvictionPolicy` (with `LRUPolicy`, and the `PoolView` it reads from
`kvreuse.core.spi`) to try another eviction order; the oracle (`kvreuse.oracle`), the slow
reference model the core is tested against; the simulator (`kvreuse.sim`).
"""

from importlib.util import find_spec as _find_spec

from kvreuse.core import *  # noqa: F403
from kvreuse.core import __all__ as _core_all

__version__ = "0.1.0"

# Loaded by `__getattr__` on first use: they import torch. Where torch is installed they are
# listed in `__all__` and `dir()` like the others (so `from kvreuse import *` loads them, and
# torch); where it is not (a core-only install) they are left out, so that star-import still
# works there and `dir()` lists only what can be loaded. Looking torch up does not import it.
_ENGINE_NAMES = ("LLM", "SamplingParams") if _find_spec("torch") is not None else ()

__all__ = [*_core_all, *_ENGINE_NAMES, "__version__"]


def __getattr__(name: str) -> object:
    """`kvreuse.LLM` / `kvreuse.SamplingParams`, imported on first use."""
    if name in ("LLM", "SamplingParams"):  # without torch, the import error says what is missing
        import kvreuse.engine

        return getattr(kvreuse.engine, name)
    raise AttributeError(f"module 'kvreuse' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_ENGINE_NAMES})
