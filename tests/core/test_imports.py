"""The import graph of `src/`: no circle among modules (type-only and function-level imports
included, because a reader follows them too), and below the facade no core module knows
`KVCacheManager`: each takes the owners it uses."""

from __future__ import annotations

import ast
from pathlib import Path

import kvreuse

SRC = Path(kvreuse.__file__).resolve().parent
CORE = SRC / "core"


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Module → the kvreuse modules it imports anywhere in its text."""
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from pkg import mod` depends on the module; `from mod import name` on `mod`
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    targets.append(sub if sub in modules else node.module)
            edges.update(t for t in targets if t in modules and t != name)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_in_src() -> None:
    circle = _cycle(_graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_detector_finds_a_circle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_facade_knows_the_manager() -> None:
    for path in sorted(CORE.rglob("*.py")):
        rel = path.relative_to(CORE).as_posix()
        if rel in ("manager.py", "__init__.py"):
            continue
        assert "KVCacheManager" not in path.read_text(), (
            f"core/{rel} names KVCacheManager; pass it the owners it uses instead"
        )
