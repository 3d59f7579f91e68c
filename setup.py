"""Build of the optional C kernels (`kvreuse.core._native`); metadata lives in pyproject.toml.

The extension is optional: when it cannot be compiled (no compiler, no Python headers, a
compiler error) the install goes on without it, printing one line, and the core runs on its
pure-Python path. `KVREUSE_NO_NATIVE=1` skips the build. The SHA-256 of the C source is
compiled in, so the loader can tell a stale build from an edited source (kvreuse/core/native.py).

Rebuild after editing `src/kvreuse/core/_csrc/` (editable installs keep the built module
next to the sources): `pip install --no-deps -e .`, or `python setup.py build_ext --inplace`
where setuptools >= 77 is installed.
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path(__file__).resolve().parent / "src" / "kvreuse" / "core" / "_csrc"


def _skip(reason: str) -> None:
    line = f"kvreuse: native kernels not built ({reason}); using the pure-Python core"
    print(line, file=sys.stderr, flush=True)


def _why(e: Exception) -> str:
    """A short reason: the compiler's own messages are already on stderr above this line."""
    text = (str(e).splitlines() or [""])[0]
    status = re.search(r"exit status (\d+)", text)
    if status:
        return f"{type(e).__name__}: the compiler exited with status {status.group(1)}"
    return f"{type(e).__name__}: {text[:200]}"


class OptionalBuildExt(build_ext):
    """`build_ext` whose failure leaves a working pure-Python install."""

    def run(self) -> None:
        if os.environ.get("KVREUSE_NO_NATIVE") == "1":
            _skip("KVREUSE_NO_NATIVE=1")
            return
        try:
            super().run()
        except Exception as e:  # no compiler at all: DistutilsPlatformError and kin
            _skip(_why(e))

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # CompileError, LinkError, a missing Python.h
            _skip(_why(e))


def source_digest(folder: Path) -> str:
    """SHA-256 over the C sources' names and bytes; kvreuse/core/native.py computes the same."""
    h = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if path.suffix in (".c", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _extension() -> Extension:
    root = Path(__file__).resolve().parent
    sources = sorted(str(p.relative_to(root)) for p in CSRC.glob("*.c"))
    # Compiler flags are Python's own (sysconfig: -O3 on the usual builds).
    return Extension(
        "kvreuse.core._native",
        sources=sources,
        depends=[str(p.relative_to(root)) for p in CSRC.glob("*.h")],
        define_macros=[("KVR_SOURCE_SHA256", f'"{source_digest(CSRC)}"')],
    )


if __name__ == "__main__":  # pip's build backend runs this file as __main__ too
    setup(ext_modules=[_extension()], cmdclass={"build_ext": OptionalBuildExt})
