"""The package layering of `src/kvreuse`, read from the source (every import, lazy ones too).

    core ← (oracle, tokenizer, sched, events, hfconfig, vocab) ← deployment ← tiering
        ← (sim, engine) ← serve ← fleet ← qualify ← geometry_cli ← cli

Each package imports only packages to its left, and the core only through its public names:
`kvreuse.core`'s (the API) and `kvreuse.core.spi`'s (the plumbing of the layers).
(Import cycles are checked for all of src by tests/core/test_imports.py.)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import kvreuse
import kvreuse.core
import kvreuse.core.spi

SRC = Path(kvreuse.__file__).parent

# The layers, bottom up: a package may import the packages of every layer below its own.
LAYERS: list[set[str]] = [
    {"core"},
    {"oracle", "tokenizer", "sched", "events", "hfconfig", "vocab"},
    {"deployment"},
    {"tiering"},
    {"sim", "engine"},
    {"serve"},
    {"fleet"},
    {"qualify"},
    {"geometry_cli"},
    {"cli"},
]
# Package (a top-level module or folder of src/kvreuse) -> the packages it may import.
ALLOWED: dict[str, set[str]] = {
    pkg: set().union(*LAYERS[:depth]) for depth, layer in enumerate(LAYERS) for pkg in layer
}
ALLOWED["__main__"] = {"cli"}
ALLOWED["kvreuse"] = {"core", "engine"}  # the facade: re-exports the core, loads LLM on first use


def _modules() -> Iterator[tuple[str, str, ast.Module]]:
    """(path relative to src, package, tree) of every module."""
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC.parent)
        parts = path.relative_to(SRC).parts
        package = "kvreuse" if parts == ("__init__.py",) else parts[0].removesuffix(".py")
        yield str(rel), package, ast.parse(path.read_text(), str(rel))


def _imports(tree: ast.Module, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import, once each; `from X import Y` names X.Y when Y is a
    module of X, else X."""
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: -node.level]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                name = f"{base}.{alias.name}"
                found.add((node.lineno, name if _is_module(name) else base))
    return sorted(found)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (SRC.parent / rel).with_suffix(".py").is_file() or (SRC.parent / rel).is_dir()


def _dotted(rel: str) -> str:
    return rel.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def test_every_package_has_a_place_in_the_layering() -> None:
    unknown = sorted({pkg for _, pkg, _ in _modules()} - set(ALLOWED))
    assert not unknown, f"packages {unknown} have no place in ALLOWED; add them to the layering"


def test_only_core_imports_core_submodules() -> None:
    bad: list[str] = []
    for rel, package, tree in _modules():
        if package == "core":
            continue
        for line, name in _imports(tree, _dotted(rel)):
            if not name.startswith("kvreuse.core.") or name == "kvreuse.core.spi":
                continue
            bad.append(
                f"{rel}:{line} imports {name}; import its names from kvreuse.core or "
                "kvreuse.core.spi"
            )
    assert not bad, "; ".join(bad)


# Where each module outside the core may take a core name from, and the names it offers there.
CORE_EXPORTS = {
    "kvreuse.core": set(kvreuse.core.__all__),
    "kvreuse.core.spi": set(kvreuse.core.spi.__all__),
    "kvreuse": set(kvreuse.__all__) | {"LLM", "SamplingParams"},
}


def test_core_names_come_from_the_api_or_the_spi() -> None:
    """`from kvreuse.core import X` names an API name, `from kvreuse.core.spi import X` an SPI
    one: a name exported by neither is the core's own."""
    bad: list[str] = []
    for rel, package, tree in _modules():
        if package in ("core", "kvreuse"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in CORE_EXPORTS:
                offered = CORE_EXPORTS[node.module]
                bad += [
                    f"{rel}:{node.lineno} imports {a.name} from {node.module}"
                    for a in node.names
                    if a.name not in offered and not _is_module(f"{node.module}.{a.name}")
                ]
    assert not bad, "; ".join(bad)


def test_each_package_imports_only_packages_to_its_left() -> None:
    bad = []
    for rel, package, tree in _modules():
        allowed = ALLOWED.get(package, set()) | {package}
        for line, name in _imports(tree, _dotted(rel)):
            parts = name.split(".")
            if parts[0] != "kvreuse":
                continue
            target = parts[1] if len(parts) > 1 else "kvreuse"
            if target not in allowed:
                bad.append(f"{rel}:{line} imports {name}; {package} may import {sorted(allowed)}")
    assert not bad, "; ".join(bad)


def test_the_server_and_the_engine_import_nothing_of_the_simulator() -> None:
    """What a command line and a server share (kvreuse.vocab, kvreuse.tiering) lives below the
    simulator: running a server does not load it."""
    bad = [
        f"{rel}:{line} imports {name}"
        for rel, package, tree in _modules()
        if package in ("serve", "engine")
        for line, name in _imports(tree, _dotted(rel))
        if name == "kvreuse.sim" or name.startswith("kvreuse.sim.")
    ]
    assert bad == []


def test_the_facade_without_torch_lists_no_engine_names() -> None:
    """A core-only install: `import kvreuse`, `dir()` and star-import work; kvreuse.LLM says
    what is missing."""
    code = (
        "import sys; sys.modules['torch'] = None\n"  # as if torch were not installed
        "import kvreuse\n"
        "assert 'LLM' not in kvreuse.__all__ and 'LLM' not in dir(kvreuse)\n"
        "from kvreuse import *\n"
        "try:\n    kvreuse.LLM\nexcept ImportError as exc:\n    assert 'torch' in str(exc)\n"
        "else:\n    raise AssertionError('kvreuse.LLM without torch')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
