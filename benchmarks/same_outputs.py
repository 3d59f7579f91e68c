#!/usr/bin/env python3
"""Does the working tree print what a revision printed? A check that a refactoring changed no
behaviour of `kvreuse workload` and `kvreuse simulate`.

    .venv/bin/python benchmarks/same_outputs.py REV [--jobs N] [--keep DIR]

It extracts revision REV of this repository into a temporary folder (`git archive`: the
repository's own worktrees and index are left alone), then runs the same commands twice, once
with that checkout's `src/` and once with the working tree's (uncommitted changes included),
each side in a folder of its own so that the paths it prints are the same:

* `kvreuse workload KIND` for five built-in workloads (small, so that the whole check takes a
  few minutes on two cores), and `kvreuse workload import` of the trace excerpts in tests/data/;
* `kvreuse simulate` of every preset (`kvreuse.deployment.PRESETS` of the working tree) over each
  workload, as text (and as `--json` for two of them); over a pressure workload with
  `--capacity-tokens` and with `--num-blocks` (evictions everywhere); over the Mooncake excerpts
  with `--trace mooncake`, with the preset's pool and with `--capacity-tokens`, and the Bailian
  excerpt; with memory tiers, `--replicas` (a store the replicas share too) and
  `--no-fast-forward` on a few presets.

Each command's stdout, stderr and exit status, and every file it writes (`requests.jsonl`,
`summary.json`, `report.md`, `fleet.json`; plots are off), are compared byte for byte, except
the wall-clock seconds a fleet simulation reports (`"wall_seconds"`), which are masked. It prints
`identical: N files` and exits 0, or a unified diff of each file that differs (and the names of
files only one side wrote) and exits 1.

Both sides run on the pure-Python core (`KVREUSE_PURE=1`, the reference): the extracted revision
has no built C kernels, and a comparison across paths would test the kernels, not the change.
Both sides run this interpreter; each side's `src/` comes first on `PYTHONPATH`, and the check
refuses to run if `kvreuse` is then imported from anywhere else (an install that shadows it).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = "tests/data"  # the trace excerpts, read from each side's own checkout
MOONCAKE = ("mooncake_conversation_excerpt.jsonl", "mooncake_synthetic_excerpt.jsonl")
BAILIAN = "bailian_schema_excerpt.jsonl"
MEASURED = re.compile(rb'("wall_seconds": )[0-9.e+-]+')

# name → `kvreuse workload` arguments: multi-turn reuse, a burst sharing a prefix, evictions,
# lengths at block boundaries, one long document
WORKLOADS: dict[str, list[str]] = {
    "agent": ["agent", "--sessions", "4", "--turns", "12", "--max-tokens", "16"],
    "shared-prefix": [
        "shared-prefix",
        "--requests",
        "16",
        "--prefix-len",
        "2048",
        "--suffix-len",
        "128",
        "--max-tokens",
        "4",
    ],
    "pressure": ["pressure", "--sequences", "10", "--length", "4096", "--max-tokens", "2"],
    "resend-grid": ["resend-grid", "--lengths", "255,256,257,2047,2048,2049,4096"],
    "retrieval": ["retrieval", "--length", "8192", "--max-tokens", "8"],
}
# presets the slower variants (tiers, replicas, the reference step path) run on
FEW = ("attention-16", "hybrid-dcp4", "tiny-sliding-hybrid", "tiny-spec-lookahead")


@dataclass(frozen=True)
class Case:
    """One command: its name (the file its output goes to) and its `kvreuse` arguments."""

    name: str
    args: list[str]


def workload_cases() -> list[Case]:
    """The workloads, written to wl/NAME.jsonl; and the trace imports (compared only)."""
    cases = [Case(f"workload-{n}", ["workload", *a]) for n, a in WORKLOADS.items()]
    for trace in MOONCAKE:
        cases.append(Case(f"import-{trace}", ["workload", "import", "mooncake", f"{DATA}/{trace}"]))
    cases.append(Case(f"import-{BAILIAN}", ["workload", "import", "bailian", f"{DATA}/{BAILIAN}"]))
    return cases


def simulate_cases(presets: list[str]) -> list[Case]:
    """Every `kvreuse simulate` this check runs: the text output where a case's result is new,
    `--json` besides for two workloads and for the variants (the same run in both formats
    would only time the interpreter's start again)."""
    cases: list[Case] = []

    def sim(name: str, formats: str, args: str) -> None:
        for fmt in formats.split(","):
            out = f"{name}.{fmt}"
            json = ["--json"] if fmt == "json" else []
            common = ["simulate", "--out", f"out/{out}", "--quiet", "--no-plots", *json]
            cases.append(Case(out, [*common, *args.split()]))

    for p in presets:
        g = f"--geometry {p}"
        for w in WORKLOADS:
            sim(
                f"{p}-{w}",
                "text,json" if w in ("agent", "pressure") else "text",
                f"{g} wl/{w}.jsonl",
            )
        sim(f"{p}-pressure-cap", "json", f"{g} --capacity-tokens 20K wl/pressure.jsonl")
        sim(f"{p}-pressure-blocks", "json", f"{g} --num-blocks 300 wl/pressure.jsonl")
        for trace in MOONCAKE:
            mooncake = f"{g} --trace mooncake {DATA}/{trace}"
            sim(f"{p}-{trace}", "text", mooncake)
            sim(f"{p}-{trace}-cap", "json", f"{mooncake} --capacity-tokens 100K --time-scale 0.5")
        sim(f"{p}-{BAILIAN}", "text", f"{g} --trace bailian {DATA}/{BAILIAN}")
    for p in FEW:
        g = f"--geometry {p}"
        tiers = "--host-capacity 30K --store-capacity 60K"
        sim(f"{p}-tiers", "json", f"{g} --capacity-tokens 20K {tiers} wl/pressure.jsonl")
        policies = "--policy exact --policy round-robin --policy text-prefix"
        sim(f"{p}-replicas", "text,json", f"{g} --replicas 3 {policies} wl/agent.jsonl")
        store = "--store-capacity 60K --store-admission write-through --capacity-tokens 20K"
        sim(f"{p}-replicas-store", "json", f"{g} --replicas 2 {store} wl/pressure.jsonl")
        sim(f"{p}-reference", "json", f"{g} --no-fast-forward wl/agent.jsonl")
    return cases


def run_case(side: Path, src: Path, case: Case) -> int:
    """Run `case` in `side` with `src` first on the path; stdout, stderr and the exit status to
    side/stdout/NAME.{out,err}; a workload's stdout to wl/KIND.jsonl too. Its exit status."""
    env = {**os.environ, "PYTHONPATH": str(src), "KVREUSE_PURE": "1", "COLUMNS": "100"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvreuse", *case.args], cwd=side, env=env, capture_output=True
    )
    (side / "stdout" / f"{case.name}.out").write_bytes(proc.stdout)
    (side / "stdout" / f"{case.name}.err").write_bytes(
        proc.stderr + f"\n[exit status {proc.returncode}]\n".encode()
    )
    if case.name.startswith("workload-"):
        (side / "wl" / f"{case.name.removeprefix('workload-')}.jsonl").write_bytes(proc.stdout)
    return proc.returncode


def run_side(side: Path, checkout: Path, presets: list[str], jobs: int) -> str:
    """Every case with `checkout`'s code, in the folder `side`: how long it took and how many
    commands failed (a failed workload stops the check: the simulations would read nothing)."""
    start = time.monotonic()
    src = checkout / "src"
    check_import(src)
    for sub in ("stdout", "wl", "out"):
        (side / sub).mkdir(parents=True)
    (side / DATA).parent.mkdir(parents=True, exist_ok=True)
    (side / DATA).symlink_to(checkout / DATA)  # the same relative path on both sides
    with ThreadPoolExecutor(jobs) as pool:
        made = workload_cases()
        for case, rc in zip(made, pool.map(lambda c: run_case(side, src, c), made), strict=True):
            if rc != 0:
                err = (side / "stdout" / f"{case.name}.err").read_text()
                sys.exit(f"same_outputs: kvreuse {' '.join(case.args)} failed in {side}:\n{err}")
        sims = simulate_cases(presets)
        failed = sum(rc != 0 for rc in pool.map(lambda c: run_case(side, src, c), sims))
    took = time.monotonic() - start
    return (
        f"{len(made) + len(sims)} commands in {took:.0f} s ({failed} simulations exited non-zero)"
    )


def check_import(src: Path) -> None:
    """Refuse to go on if `kvreuse` does not come from `src` (an install shadowing it)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    where = subprocess.run(
        [sys.executable, "-c", "import kvreuse; print(kvreuse.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(src.resolve()):
        sys.exit(f"same_outputs: kvreuse is imported from {where}, not from {src}")


def presets_of(src: Path) -> list[str]:
    """The preset names of the code in `src`."""
    code = "from kvreuse.deployment import PRESETS; print('\\n'.join(sorted(PRESETS)))"
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"same_outputs: cannot list the presets:\n{proc.stderr}")
    return proc.stdout.split()


def extract(rev: str, into: Path) -> str:
    """Revision `rev` of this repository into `into`; its full commit id."""
    git = ["git", "-C", str(ROOT)]
    proc = subprocess.run(
        [*git, "rev-parse", "--verify", f"{rev}^{{commit}}"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"same_outputs: {rev!r} is not a commit of {ROOT}")
    commit = proc.stdout.strip()
    into.mkdir()
    archive = subprocess.Popen([*git, "archive", commit], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        sys.exit(f"same_outputs: git archive {commit} failed")
    return commit


def files_under(folder: Path) -> set[Path]:
    """Every file under `folder` (the traces' link not followed), relative to it."""
    return {
        p.relative_to(folder)
        for p in folder.rglob("*")
        if p.is_file() and "tests" not in p.relative_to(folder).parts[:1]
    }


def masked(data: bytes) -> bytes:
    """`data` with the wall-clock times a fleet simulation reports replaced by a mark: the one
    output that is measured, not computed."""
    return MEASURED.sub(rb'\1"(wall clock)"', data)


def compare(before: Path, after: Path, most: int) -> int:
    """Print what differs between the two sides (at most `most` diff lines a file); the number
    of files that differ or exist on one side only."""
    a, b = files_under(before), files_under(after)
    bad = 0
    for rel in sorted(a ^ b):
        print(f"only in {'the revision' if rel in a else 'the working tree'}: {rel}")
        bad += 1
    for rel in sorted(a & b):
        old, new = masked((before / rel).read_bytes()), masked((after / rel).read_bytes())
        if old == new:
            continue
        bad += 1
        lines = difflib.unified_diff(
            old.decode(errors="replace").splitlines(),
            new.decode(errors="replace").splitlines(),
            f"revision/{rel}",
            f"working-tree/{rel}",
            lineterm="",
        )
        diff = list(lines)
        print("\n".join(diff[:most]))
        if len(diff) > most:
            print(f"… {len(diff) - most} more diff lines")
    print(f"identical: {len(a & b)} files" if not bad else f"differ: {bad} of {len(a | b)} files")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="the revision to compare the working tree with (a commit-ish)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="commands at once")
    ap.add_argument("--keep", type=Path, help="leave both sides' outputs in this new folder")
    ap.add_argument("--diff-lines", type=int, default=40, help="diff lines shown per file")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="same-outputs-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=work == Path(tmp))
        checkout = work / "checkout"
        commit = extract(args.rev, checkout)
        presets = presets_of(ROOT / "src")
        print(f"{commit[:12]} vs the working tree: {len(presets)} presets", file=sys.stderr)
        for label, side, code in (
            ("revision", work / "before", checkout),
            ("working tree", work / "after", ROOT),
        ):
            print(f"{label}: {run_side(side, code, presets, args.jobs)}", file=sys.stderr)
        bad = compare(work / "before", work / "after", args.diff_lines)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
