"""The core is pure: no I/O, no torch/numpy/asyncio (every module, subpackages included). Its
public surface is exactly `__all__` (the API) and `kvreuse.core.spi.__all__` (the plumbing of
the layers above), each pinned here; the tree is ruff- and mypy-clean."""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
import types
import warnings
from pathlib import Path

import pytest

import kvreuse
import kvreuse.core
import kvreuse.core.spi

CORE = Path(kvreuse.core.__file__).parent
FORBIDDEN = {
    "torch",
    "numpy",
    "asyncio",
    "socket",
    "threading",
    "subprocess",
    "io",
    "pathlib",
    "os.path",
    "logging",
    "urllib",
    "http",
    "multiprocessing",
    "fastapi",
    "uvicorn",
    "prometheus_client",
}
ALLOWED_THIRD_PARTY = {"xxhash", "blake3"}
# The loader of the optional C kernels decides once, at import, which path the core runs: it
# reads the C sources' digest (a stale build must not shadow an edit) and may log one warning.
LOADER_EXCEPTIONS = {"native.py": {"logging", "open"}}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _core_modules() -> list[tuple[str, Path]]:
    """(path relative to the core, path) of every module of the core, subpackages included."""
    return [(path.relative_to(CORE).as_posix(), path) for path in sorted(CORE.rglob("*.py"))]


def test_core_imports_no_io_or_heavy_packages() -> None:
    for rel, path in _core_modules():
        for name in _imports(path) - LOADER_EXCEPTIONS.get(rel, set()):
            top = name.split(".")[0]
            assert top not in FORBIDDEN and name not in FORBIDDEN, f"{rel} imports {name}"
            if top not in {"kvreuse", "__future__"} and top not in ALLOWED_THIRD_PARTY:
                spec = importlib.util.find_spec(top)
                assert spec is not None and (
                    spec.origin in ("built-in", "frozen") or "site-packages" not in str(spec.origin)
                ), f"{rel} imports third-party module {name}"


def test_core_calls_no_open_or_print() -> None:
    for rel, path in _core_modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                allowed = LOADER_EXCEPTIONS.get(rel, set())
                assert node.func.id not in {"open", "print", "input"} - allowed, (
                    f"{rel}:{node.lineno} calls {node.func.id}()"
                )


def test_the_checks_see_the_subpackages() -> None:
    seen = {rel for rel, _ in _core_modules()}
    assert "kinds/base.py" in seen and "native.py" in seen


# What an engine builder needs: the manager, its configuration and geometry, requests, results,
# events, errors, tiers and their ops, eviction policies, the lookup over one's own index. A
# name joins by an edit here, so that the API grows only on purpose.
API = {
    "KVCacheManager",
    "CacheConfig",
    "GroupSpec",
    "Geometry",
    "GroupGeometry",
    "Request",
    "MultiModalItem",
    "LookupResult",
    "Reason",
    "RequestPlan",
    "StepPlan",
    "Copy",
    "Save",
    "RecurrentSlot",
    "Outcome",
    "RequestStats",
    "Event",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "StoredEntry",
    "EntryKind",
    "TierStored",
    "TierRemoved",
    "ConfigError",
    "StaleLookupError",
    "UnknownRequestError",
    "InvariantError",
    "SharedTierBusyError",
    "TierSpec",
    "Admission",
    "SharedTier",
    "TierOp",
    "Demote",
    "Move",
    "Load",
    "EvictionPolicy",
    "LRUPolicy",
    "IndexView",
    "compute_lookup",
}
# What the project's own layers and the core's extensions (a kind, a policy) use beyond it.
SPI = {
    "Hasher",
    "Chain",
    "TOKEN_TYPECODE",
    "Stage",
    "PagedGroup",
    "StateGroup",
    "Probe",
    "PlainAsk",
    "register_kind",
    "unregister_kind",
    "PoolView",
    "DEVICE_MEDIUM",
    "TierState",
    "LayeredIndex",
    "tier_sources",
    "tier_hit_tokens",
    "finish_point",
    "replay_point",
    "Deferral",
    "SavePurpose",
    "StepFate",
    "describe_core_path",
}


def test_the_api_and_the_spi_are_pinned() -> None:
    assert set(kvreuse.core.__all__) == API, "kvreuse.core.__all__ changed: edit API on purpose"
    assert set(kvreuse.core.spi.__all__) == SPI, "kvreuse.core.spi.__all__ changed: edit SPI"
    assert not API & SPI
    assert len(kvreuse.core.__all__) == len(API) and len(kvreuse.core.spi.__all__) == len(SPI)


def test_all_matches_public_names() -> None:
    for mod in (kvreuse, kvreuse.core, kvreuse.core.spi):
        public = {
            n
            for n in dir(mod)
            if not n.startswith("_") and not isinstance(getattr(mod, n), types.ModuleType)
        }
        exported = {n for n in mod.__all__ if not n.startswith("_")}
        assert exported == public, f"{mod.__name__}: __all__ and public names differ"
        assert all(hasattr(mod, n) for n in mod.__all__)


def test_spec_surface_is_exported() -> None:
    for name in (
        "CacheConfig",
        "GroupSpec",
        "KVCacheManager",
        "Request",
        "MultiModalItem",
        "LookupResult",
        "RequestPlan",
        "StepPlan",
        "Copy",
        "Save",
        "RequestStats",
        "ConfigError",
        "StaleLookupError",
        "InvariantError",
        "EvictionPolicy",
    ):
        assert name in kvreuse.__all__, name


# A module is split where a responsibility ends, not at a line count. Past LONG lines a module
# is worth a second look (a warning names it); past TOO_LONG it certainly holds more than one
# responsibility: twice the look-again size, about what one reader keeps in mind at once.
LONG = 420
TOO_LONG = 800


@pytest.mark.filterwarnings("default::UserWarning")  # a warning here, not the suite's error
def test_modules_stay_small() -> None:
    for path in sorted(CORE.parent.rglob("*.py")):
        rel = path.relative_to(CORE.parents[1]).as_posix()
        lines = len(path.read_text().splitlines())
        assert lines <= TOO_LONG, f"{rel} has {lines} lines; split it where a responsibility ends"
        if lines > LONG:
            warnings.warn(
                f"{rel} has {lines} lines (over {LONG}): does it hold one responsibility?",
                stacklevel=1,
            )


@pytest.mark.lint
def test_ruff_clean() -> None:
    """The lint gate runs with the tests, so CI and the README's test command cannot drift."""
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    root = CORE.parents[2]
    proc = subprocess.run([ruff, "check", str(root)], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fmt = [ruff, "format", "--check", "src", "tests", "benchmarks"]
    proc = subprocess.run(fmt, capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, "run `ruff format src tests benchmarks`:\n" + proc.stdout


@pytest.mark.lint
def test_mypy_clean() -> None:
    """Types are checked with the tests too (configuration in pyproject.toml, [tool.mypy])."""
    mypy = str(Path(sys.executable).parent / "mypy")  # the test venv's, pinned by the extra
    if not Path(mypy).exists():
        pytest.skip("mypy is not installed (pip install -e '.[test]')")
    root = CORE.parents[2]
    proc = subprocess.run([mypy], capture_output=True, text=True, cwd=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
