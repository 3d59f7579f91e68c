"""Every fenced command and Python block of README.md and docs/*.md runs, in order, as printed,
so a doc example that stops working fails here.

Each doc's blocks run one after another in a fresh directory of their own (the files one block
writes are there for the next), with `kvreuse` and `python` of this interpreter on PATH and
`.venv`, `benchmarks/` and `tests/` of this checkout beside them. A fence's info string says
what it is: `bash` (run; every command must succeed), `python` (run as a script), `toml` (a
geometry file, which must load), `text` (output, diagrams, formulas: not run, except its
`$ COMMAND` lines, which are). An HTML comment on the line above a fence, one per line, may say:

    <!-- doc-test: skip: REASON -->        not run, and why (a server that waits for requests,
                                           data the repository does not hold)
    <!-- doc-test: sub: OLD => NEW -->     run with OLD replaced by NEW (small inputs for a
                                           heavy command; the doc names the full one)
    <!-- doc-test: before: COMMAND -->     a shell command run first (a file the text assumes)
    <!-- doc-test: file: NAME -->          toml: written to NAME for the blocks after it
    <!-- doc-test: needs: MODULE EXTRA --> skipped, naming the extra, where MODULE is missing
    <!-- doc-test: venv: NAME SCRIPT -->    run with the venv NAME of the repository root beside
                                           it (`NAME/bin/python` as printed); where it is absent,
                                           skipped naming SCRIPT, which builds it, and failed
                                           under CI, which builds it (tests/needs.py)
    <!-- doc-test: timeout: SECONDS -->    a longer limit than the default
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from needs import missing

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = {"bash", "python", "toml", "text"}
DIRECTIVE = re.compile(
    r"^\s*<!-- doc-test: (skip|sub|before|file|needs|venv|timeout): (.*?) -->\s*$"
)
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
TIMEOUT_S = 120


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence, 1-based
    kind: str
    text: str
    skip: str | None = None
    subs: list[tuple[str, str]] = field(default_factory=list)
    before: list[str] = field(default_factory=list)
    file: str | None = None
    needs: list[tuple[str, str]] = field(default_factory=list)
    venvs: list[tuple[str, str]] = field(default_factory=list)  # (NAME, SCRIPT)
    timeout: int = TIMEOUT_S

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def source(self) -> str:
        text = self.text
        for old, new in self.subs:
            assert old in text, f"{self.where}: substitution {old!r} matches nothing"
            text = text.replace(old, new)
        return text


def blocks(doc: Path) -> list[Block]:
    lines = doc.read_text(encoding="utf-8").split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, kind = m.group(1), m.group(2)
        j = i + 1
        while not re.match(rf"^{indent}```\s*$", lines[j]):
            j += 1
        body = "\n".join(line[len(indent) :] for line in lines[i + 1 : j])
        block = Block(doc, i + 1, kind, body + "\n")
        k = i - 1
        while k >= 0 and DIRECTIVE.match(lines[k]):
            _directive(block, *DIRECTIVE.match(lines[k]).groups())  # type: ignore[union-attr]
            k -= 1
        out.append(block)
        i = j + 1
    return out


def _directive(block: Block, name: str, value: str) -> None:
    if name == "skip":
        block.skip = value
    elif name == "sub":
        old, sep, new = value.partition(" => ")
        assert sep, f"{block.where}: sub needs OLD => NEW"
        block.subs.insert(0, (old, new))
    elif name == "before":
        block.before.insert(0, value)
    elif name == "file":
        block.file = value
    elif name == "needs":
        module, _, extra = value.partition(" ")
        block.needs.append((module, extra))
    elif name == "venv":
        venv, _, script = value.partition(" ")
        assert script, f"{block.where}: venv needs NAME SCRIPT"
        block.venvs.append((venv, script))
    else:
        block.timeout = int(value)


ALL = [b for doc in DOCS for b in blocks(doc)]
RUNNABLE = [b for b in ALL if b.kind != "text" or "\n$ " in "\n" + b.text]


def test_every_fence_says_what_it_is() -> None:
    untagged = [b.where for b in ALL if b.kind not in KINDS]
    assert untagged == [], f"fences without bash/python/toml/text: {untagged}"
    assert len(RUNNABLE) >= 30


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    return {}


def _workdir(doc: Path, dirs: dict[Path, Path], factory: pytest.TempPathFactory) -> Path:
    if doc not in dirs:
        work = factory.mktemp(doc.stem)
        for name, target in ((".venv", Path(sys.prefix)), ("benchmarks", ROOT / "benchmarks")):
            (work / name).symlink_to(target, target_is_directory=True)
        (work / "tests").symlink_to(ROOT / "tests", target_is_directory=True)
        dirs[doc] = work
    return dirs[doc]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("KVREUSE_HYPOTHESIS_PROFILE", None)
    return env


def _run(argv: list[str], work: Path, block: Block) -> None:
    try:
        done = subprocess.run(
            argv,
            cwd=work,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=block.timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{block.where}: did not finish within {block.timeout} s: {argv[-1][:200]}")
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        pytest.fail(f"{block.where}: exit {done.returncode}\n{argv[-1][:2000]}\n---\n{tail}")


def _commands(block: Block) -> str:
    """A text block's `$ COMMAND` lines (with their continuation lines)."""
    out, keep = [], False
    for line in block.source().splitlines():
        if line.startswith("$ "):
            out.append(line[2:])
            keep = line.endswith("\\")
        elif keep:
            out.append(line)
            keep = line.endswith("\\")
    return "\n".join(out) + "\n"


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_the_block_runs_as_printed(
    block: Block, workdirs: dict[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    if block.skip:
        pytest.skip(block.skip)
    for module, extra in block.needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}: pip install -e '.[{extra}]'")
    for venv, script in block.venvs:
        if not (ROOT / venv / "bin" / "python").exists():
            missing(f"{venv} (for {block.where})", f"bash {script}")
    work = _workdir(block.doc, workdirs, tmp_path_factory)
    for venv, _ in block.venvs:
        if not (work / venv).exists():
            (work / venv).symlink_to(ROOT / venv, target_is_directory=True)
    for command in block.before:
        _run(["bash", "-euo", "pipefail", "-c", command], work, block)
    if block.kind == "bash":
        _run(["bash", "-euo", "pipefail", "-c", block.source()], work, block)
    elif block.kind == "text":
        _run(["bash", "-euo", "pipefail", "-c", _commands(block)], work, block)
    elif block.kind == "python":
        script = work / f"block_{block.line}.py"
        script.write_text(block.source(), encoding="utf-8")
        _run([sys.executable, str(script)], work, block)
    else:  # toml: a geometry file, which must load
        path = work / (block.file or f"block_{block.line}.toml")
        path.write_text(block.source(), encoding="utf-8")
        from kvreuse.deployment import resolve

        resolve(path)
