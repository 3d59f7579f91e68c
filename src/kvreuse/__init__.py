"""kvreuse: exact prefix-cache reuse for LLM serving.

The core (`kvreuse.core`) is pure Python and is re-exported here; the oracle (`kvreuse.oracle`)
is the slow reference model the core is tested against.
"""

from kvreuse.core import *  # noqa: F403
from kvreuse.core import __all__ as _core_all

__version__ = "0.1.0"
__all__ = [*_core_all, "__version__"]
