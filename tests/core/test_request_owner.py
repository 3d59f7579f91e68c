"""One owner per request: `RequestState`'s fields change only inside its own class.

Every module of the core is read as a syntax tree. Outside `class RequestState`, no statement
may assign, augment or delete `x.f` (or `x.f[...]`, `x.f.g`) for a field name f of
RequestState, nor call a mutating method on it (`x.f.append(...)`, `x.f[k].extend(...)`),
unless x is `self` (a class changing its own attribute of the same name). Outside the core a
RequestState is reachable only through a manager's `requests` (the class is not exported, and
only the core imports core submodules: tests/sim/test_packages.py), so there the same reading
covers chains through `.requests[...]`; other classes' fields of the same names (a scheduler's
`Seq.scheduled`) are theirs. A change made through a local alias (`row = st.tables[g];
row[0] = 0`) is not seen by this reading; the core has none (the methods of RequestState are
where such loops live).
"""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

import kvreuse
from kvreuse.core.request import RequestState

SRC = Path(kvreuse.__file__).resolve().parent
FIELDS = {f.name for f in fields(RequestState)}
MUTATORS = {
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault",
    "sort", "reverse", "discard", "add", "__setitem__", "__delitem__", "fromlist", "frombytes",
}  # fmt: skip


def _through_requests(node: ast.expr) -> bool:
    """Whether the chain `node` reads a manager's `requests[...]`."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Subscript) and getattr(node.value, "attr", None) == "requests":
            return True
        node = node.value
    return False


def _field_in(node: ast.expr, core: bool) -> str | None:
    """The RequestState field that `node` (an attribute/subscript chain) reaches into through
    something other than `self` (outside the core: through `.requests[...]`), or None."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute) and node.attr in FIELDS:
            base = node.value
            if core and not (isinstance(base, ast.Name) and base.id == "self"):
                return node.attr
            if not core and _through_requests(base):
                return node.attr
        node = node.value
    return None


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        out: list[ast.expr] = []
        for t in node.targets:
            out.extend(t.elts if isinstance(t, ast.Tuple) else [t])
        return out
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    return []


def violations(source: str, where: str, core: bool = True) -> list[str]:
    """`where:line: what` for every change of a RequestState field outside its class."""
    tree = ast.parse(source)
    allowed: set[int] = set()  # ids of the nodes inside `class RequestState`
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "RequestState":
            allowed.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if id(node) in allowed:
            continue
        for target in _targets(node):
            name = _field_in(target, core)
            if name is not None:
                found.append(f"{where}:{node.lineno}: changes .{name}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
            and (name := _field_in(node.func.value, core)) is not None
        ):
            found.append(f"{where}:{node.lineno}: .{name}.{node.func.attr}(...)")
    return found


def test_request_state_fields_change_only_inside_its_class() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        text = path.read_text()
        core = rel.parts[0] == "core"
        if not core and "RequestState" in text:
            found.append(f"{rel}: names RequestState outside the core")
        found += violations(text, str(rel), core)
    assert not found, "RequestState fields changed outside its methods:\n" + "\n".join(found)


def test_the_reading_finds_each_form_of_change() -> None:
    cases = [
        "st.committed = 3",
        "st.hit += 1",
        "a, st.hit = 1, 2",
        "req.tables[gid] = []",
        "req.tables[gid][0] = 0",
        "del req.processed[gid]",
        "req.inflight.append(1)",
        "req.tables[gid].extend(blocks)",
        "req.recurrent[gid].held[c] = b",
        "req.tokens.extend(t)",
    ]
    for case in cases:
        assert violations(case, "x"), case
    ok = [
        "x = st.committed",
        "self.hit = 1",
        "req.commit_to(3)",
        "n = len(req.tables[0])",
        "class RequestState:\n    def f(self, o):\n        o.hit = 1",
    ]
    for case in ok:
        assert not violations(case, "x"), case
    assert violations("mgr.requests[rid].hit = 0", "x", core=False)
    assert violations("m.requests['a'].tables[0].append(1)", "x", core=False)
    assert not violations("seq.scheduled = 3", "x", core=False)
