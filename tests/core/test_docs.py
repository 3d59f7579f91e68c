"""The repository explains itself: every relative link and every repository path that README.md
and the guides name resolves inside the repository (in the working tree and in a fresh clone),
nothing points at files outside it, every "§N.M" that code and docs cite is a section of
docs/semantics.md, and the vLLM comparison runs from files of the repository."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from needs import missing

ROOT = Path(__file__).resolve().parents[2]
# Spelled in two parts so that this file does not match itself.
OUTSIDE = "../" + "shared"

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)
# A repository path named in prose or code spans, e.g. `docs/simulate.md` or benchmarks/vllm/.
PATH = re.compile(r"(?<![\w./-])((?:docs|benchmarks|src|tests)/[\w./*-]*[\w/*])")
UP = re.compile(r"(?<![\w./-])((?:\.\./)+[\w.-][\w./-]*)")  # ../x: relative to the root too
ANCHOR = re.compile(r"""<a\s+id=["']([^"']+)["']""")
SECTION = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", re.M)
CITED = re.compile(r"§\s?(\d+(?:\.\d+)?)")


def guides(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """The anchor a Markdown renderer derives from a heading (GitHub's rule)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = md.read_text(encoding="utf-8")
    found = set(ANCHOR.findall(text))
    found |= {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}
    return found


def broken_references(root: Path) -> list[str]:
    """Every link or named path in README.md and docs/*.md that does not resolve in `root`."""
    broken: list[str] = []
    for doc in guides(root):
        text = doc.read_text(encoding="utf-8")
        where = doc.relative_to(root)
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if root.resolve() not in (dest, *dest.parents):
                broken.append(f"{where}: link {target} leaves the repository")
            elif not dest.exists():
                broken.append(f"{where}: link {target} names a missing file")
            elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
                broken.append(f"{where}: link {target} names a missing anchor")
        for named in UP.findall(text):
            if root.resolve() not in (root / named).resolve().parents:
                broken.append(f"{where}: {named} is outside the repository")
        for named in PATH.findall(text):
            path = named.split("#")[0].rstrip(".")
            if "*" in path:
                if not list(root.glob(path)):
                    broken.append(f"{where}: {named} matches nothing")
            elif not (root / path).exists():
                broken.append(f"{where}: {named} does not exist")
    return broken


def repository_files(root: Path) -> list[Path]:
    """Tracked and untracked-but-not-ignored files (every file when git is unavailable)."""
    git = shutil.which("git")
    if git and (root / ".git").exists():
        out = subprocess.run(
            [git, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout
        names = [n for n in out.decode().split("\0") if n]
        return [root / n for n in names if (root / n).is_file()]
    skip = {".git", ".venv", "build", "dist", "__pycache__"}
    return [
        p
        for p in root.rglob("*")
        if p.is_file()
        and not skip & set(p.relative_to(root).parts)
        and not any(part.startswith((".venv", ".")) for part in p.relative_to(root).parts[:-1])
        and not any(part.endswith(".egg-info") for part in p.relative_to(root).parts)
    ]


def mentions_outside(root: Path) -> list[str]:
    needle = OUTSIDE.encode()
    return [str(p.relative_to(root)) for p in repository_files(root) if needle in p.read_bytes()]


def test_every_link_and_named_path_resolves_in_the_working_tree() -> None:
    assert broken_references(ROOT) == []


def test_no_file_points_outside_the_repository() -> None:
    assert mentions_outside(ROOT) == []


def test_a_fresh_clone_resolves_every_link(tmp_path: Path) -> None:
    """What a new user gets: only committed files. (New files must be committed for this.)"""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    clone = tmp_path / "clone"
    subprocess.run([git, "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=120)
    assert broken_references(clone) == []
    assert mentions_outside(clone) == []


def test_every_cited_section_exists_in_semantics() -> None:
    semantics = ROOT / "docs" / "semantics.md"
    sections = set(SECTION.findall(semantics.read_text(encoding="utf-8")))
    assert {"7.2", "12.3", "16"} <= sections  # the numbering the code cites
    cited: dict[str, set[str]] = {}
    files = [*guides(ROOT), *ROOT.glob("benchmarks/**/*.md")]
    files += [*ROOT.glob("src/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("benchmarks/*.py")]
    for path in files:
        for number in CITED.findall(path.read_text(encoding="utf-8")):
            if number not in sections:
                cited.setdefault(number, set()).add(str(path.relative_to(ROOT)))
    assert cited == {}, "sections cited but not in docs/semantics.md"


def test_the_vllm_comparison_uses_files_of_the_repository() -> None:
    """`core_bench.py --with-anchor` runs, by default, the driver in benchmarks/vllm/."""
    code = "import core_bench; print(core_bench.DEFAULT_ANCHOR_DIR)"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT / "benchmarks",
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    anchor_dir = Path(proc.stdout.strip()).resolve()
    assert ROOT in anchor_dir.parents, f"{anchor_dir} is outside the repository"
    assert (anchor_dir / "core_driver.py").is_file()
    assert (ROOT / "benchmarks" / "vllm" / "setup_venv.sh").is_file()


def test_core_bench_prints_ratios_against_the_repository_driver() -> None:
    """The driver's records carry what `benchmarks/anchor.py` reads (needs the vLLM venv that
    `benchmarks/vllm/setup_venv.sh` builds; skipped without it, failed under CI). Values are
    not asserted."""
    python = ROOT / ".venv-vllm-anchor" / "bin" / "python"
    if not python.exists():
        missing("vLLM 0.33.0's venv (.venv-vllm-anchor)", "bash benchmarks/vllm/setup_venv.sh")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "core_bench.py"), "--json", "--quick"]
    cmd += ["--only", "lookup,memory", "--with-anchor", "--anchor-repeat", "1"]
    cmd += ["--anchor-dir", str(ROOT / "benchmarks" / "vllm"), "--anchor-python", str(python)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    metrics = {json.loads(line)["metric"] for line in proc.stdout.splitlines()}
    assert "anchor_unavailable" not in metrics, proc.stdout
    assert {"lookup_full_hit_ratio", "bytes_per_cached_block_ratio"} <= metrics, proc.stderr
