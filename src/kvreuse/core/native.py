"""Which implementation the core runs: the optional C kernels (``"native"``) or pure Python.

Decided once, at import:

* ``KVREUSE_PURE=1`` in the environment forces the pure path (``0`` or unset: the default);
* the extension ``kvreuse.core._native`` is used when it was built and imports, and its
  compiled-in digest matches the C sources in ``_csrc/`` beside it (an editable install keeps
  the built module next to the sources, so an edited source with a stale build is caught here);
* otherwise the pure path, with one warning line through `logging` when an extension exists
  but cannot be used (a failed import, a stale or incomplete build). A build that was never
  made (no compiler at install time) is silent: the native path is optional.

The pure-Python code is the reference; a kernel implements one owner's method on that owner's
own state, except `Ghost`, a C type with the whole interface of the ghost record (ghost.py's
`GhostRecord`: a ring and a hash table instead of a dict per group). Owners read `ext` when they
are constructed, so a test can build both paths side by
side by setting ``native.ext = None`` first. This is the one core module that does I/O: it
reads the environment and the C sources once, and may log one line.

Rebuild after editing ``_csrc/``: ``pip install --no-deps -e .`` (or
``python setup.py build_ext --inplace`` where setuptools >= 77 is installed).
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from types import ModuleType

# Every name the Python side calls: a build lacking one is treated as stale.
KERNELS = (
    "sha256_units",
    "lru_pop_many",
    "lru_link",
    "ref_adopt",
    "evict_keys",
    "publish_keys",
    "release_refs",
    "Ghost",
    "BlockTable",
)
_log = logging.getLogger(__name__)


def _source_digest() -> str | None:
    """The digest of the C sources in ``_csrc/`` beside this module (as setup.py computes it),
    or None when they are not there."""
    folder = os.path.join(os.path.dirname(__file__), "_csrc")
    h = hashlib.sha256()
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith((".c", ".h")))
        for name in names:
            with open(os.path.join(folder, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    except OSError:
        return None
    return h.hexdigest() if names else None


def _load() -> tuple[ModuleType | None, str]:
    """``(extension or None, reason)``; logs one warning when an extension is unusable."""
    flag = os.environ.get("KVREUSE_PURE", "")
    if flag not in ("", "0", "1"):
        _log.warning(
            "kvreuse: KVREUSE_PURE must be 0 or 1, got %r; using the pure-Python core", flag
        )
        return None, f"KVREUSE_PURE={flag!r}"
    if flag == "1":
        return None, "KVREUSE_PURE=1"
    try:
        import kvreuse.core._native as _native  # a compiled module: no edge in the import graph
    except ModuleNotFoundError as e:
        if e.name == "kvreuse.core._native":
            return None, "native kernels not built"
        return _unusable("import failed", str(e))
    except Exception as e:  # an ABI mismatch or a broken build raises ImportError or worse
        return _unusable("import failed", f"{type(e).__name__}: {e}")
    missing = [k for k in KERNELS if not hasattr(_native, k)]
    if missing:
        return _unusable("stale build", f"it lacks {', '.join(missing)}")
    src = _source_digest()
    if src is not None and src != getattr(_native, "SOURCE_SHA256", None):
        return _unusable("stale build", "the C sources changed since it was compiled")
    return _native, f"C kernels, SHA-256 via {_native.SHA256_BACKEND}"


def _unusable(reason: str, detail: str) -> tuple[None, str]:
    """One warning line; `reason` (short) is what `kvreuse --version` shows."""
    _log.warning(
        "kvreuse: native kernels unusable (%s: %s); using the pure-Python core. Rebuild: "
        "pip install --no-deps -e .",
        reason,
        detail,
    )
    return None, reason


ext, REASON = _load()
ACTIVE = "native" if ext is not None else "pure"


def describe() -> str:
    """For ``kvreuse --version``: the active path and why."""
    return f"{'native' if ACTIVE == 'native' else 'pure-Python'} core ({REASON})"


def chain_kernel(algo: str) -> Callable[..., list[bytes]] | None:
    """The kernel that digests a run of chained units for `algo`, or None for the Python loop.

    Only SHA-256 has one, and only through libcrypto: the portable C digest is slower than
    hashlib (which uses the same libcrypto), so it is not worth a kernel call. "sha256_cbor"
    (vLLM's chain) has none on purpose: the kernel splices kvreuse's encoding, not CBOR, so
    both cores run `kvreuse.core.hashing.cbor`'s Python for it.
    """
    if ext is None or algo != "sha256" or ext.SHA256_BACKEND != "libcrypto":
        return None
    kernel: Callable[..., list[bytes]] = ext.sha256_units
    return kernel
