"""`kvreuse simulate` on generated geometries and workloads, valid and not: every case ends, within
its time limit, with results (exit 0, or 1 naming requests that exceed the cache) or with one
clear error line (exit 2). Nothing hangs, nothing raises a traceback."""

from __future__ import annotations

import contextlib
import io
import json
import math
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from depth import scaled
from kvreuse.cli import main

CASE_LIMIT_S = 10.0  # one case; the cases are small, so a case this slow is a hang
NUM_CASES = 400


class CaseTimeout(BaseException):
    """Raised in the case by an interval timer: a BaseException, so no handler swallows it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise CaseTimeout(f"a case ran past its {seconds} s limit")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v == math.inf else repr(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"


# Mostly sensible values; in about one case in five, one of the mistakes the issue lists (a
# wrong type, a string for a boolean, a size at or past 2**63, an absurd pool, a typo'd key, a
# table of the wrong type, text that is not TOML).
WRONG = st.sampled_from(["16", "x", 1.5, True, [1, 2], 2**63, -(2**63) - 1, 10**9, 0, -3])
MISTAKES = (
    "value",
    "bool-string",
    "unknown-key",
    "cache-not-table",
    "groups-not-tables",
    "not-toml",
    "no-groups",
)


@st.composite
def group(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(["full", "full", "full", "sliding", "chunked", "recurrent"]))
    g: dict[str, Any] = {"kind": kind, "block_size": draw(st.sampled_from([1, 2, 4, 8, 16, 32]))}
    if kind == "sliding":
        g["window"] = draw(st.integers(2, 300))
    if kind == "chunked":
        g["chunk"] = g["block_size"] * draw(st.integers(1, 8))
    if kind == "full" and draw(st.integers(0, 5)) == 0:
        g["role"] = "draft"
    return g


@st.composite
def geometry(draw: st.DrawFn) -> str:
    cache: dict[str, Any] = {"num_blocks": draw(st.integers(2, 400))}
    optional = {
        "dcp_size": st.sampled_from([1, 2, 4]),
        "spec_mode": st.sampled_from(["none", "lookahead", "drop"]),
        "num_spec_tokens": st.integers(0, 6),
        "max_num_batched_tokens": st.integers(1, 600),
        "max_num_seqs": st.integers(1, 8),
        "max_model_len": st.integers(1, 5000),
        "enable_prefix_caching": st.booleans(),
        "defer_shared_prefix": st.booleans(),
        "admission_watermark_blocks": st.integers(0, 8),
        "recurrent_retention": st.sampled_from(["sparse", "dense"]),
    }
    for key in draw(st.lists(st.sampled_from(sorted(optional)), max_size=5, unique=True)):
        cache[key] = draw(optional[key])
    groups = draw(st.lists(group(), min_size=1, max_size=3))
    # (Hypothesis leans towards the smallest choices: the mistake is the largest one)
    mistake = draw(st.sampled_from(MISTAKES)) if draw(st.integers(0, 4)) == 4 else None
    if mistake == "value":
        table = draw(st.sampled_from([cache, *groups]))
        table[draw(st.sampled_from(sorted(table)))] = draw(WRONG)
    elif mistake == "bool-string":
        cache[draw(st.sampled_from(["enable_prefix_caching", "defer_shared_prefix"]))] = "no"
    elif mistake == "unknown-key":
        cache[draw(st.sampled_from(["num_blok", "colour", "max_num_seq"]))] = 1
    elif mistake == "no-groups":
        groups = []
    lines = ["[cache]", *(f"{k} = {toml_value(v)}" for k, v in cache.items())]
    for g in groups:
        lines += ["[[groups]]", *(f"{k} = {toml_value(v)}" for k, v in g.items())]
    text = "\n".join(lines) + "\n"
    if mistake == "cache-not-table":
        text = "cache = 5\n" + text.replace("[cache]\n", "[other]\n")
    elif mistake == "groups-not-tables":
        text = "groups = [1, 2]\n" + text.replace("[[groups]]", "[[g]]")
    elif mistake == "not-toml":
        text = text[: len(text) // 2] + "= ="
    return text


BAD_ARRIVAL = st.sampled_from([float("nan"), float("inf"), -1.0, 1e300, "1"])


@st.composite
def workload(draw: st.DrawFn) -> str:
    lines: list[str] = []
    ids: list[str] = []
    for i in range(draw(st.integers(0, 6)) or draw(st.integers(0, 6))):  # rarely none
        rid = f"r{i}"
        length = draw(st.integers(1, 3000)) if draw(st.integers(0, 19)) < 19 else 0
        prompt: dict[str, Any] = {"random": {"seed": i, "len": length}}
        if ids and draw(st.integers(0, 3)) == 0:
            prompt = {"concat": [{"history": draw(st.sampled_from(ids))}, prompt]}
        obj: dict[str, Any] = {
            "id": rid,
            "prompt": prompt,
            "max_tokens": draw(st.integers(1, 16)) if draw(st.integers(0, 9)) < 9 else draw(WRONG),
        }
        if draw(st.booleans()):
            obj["arrival"] = (
                draw(st.floats(0, 2)) if draw(st.integers(0, 9)) < 9 else draw(BAD_ARRIVAL)
            )
        if ids and draw(st.integers(0, 3)) == 0:
            obj["after"] = draw(st.sampled_from(ids))
        line = json.dumps(obj)  # writes NaN and Infinity as Python's reader accepts them
        if draw(st.integers(0, 49)) == 49:
            line = line[:-3]  # not JSON
        lines.append(line)
        ids.append(rid)
    return "\n".join(lines) + "\n"


COST = st.sampled_from(
    [*[[]] * 30, ["--draft-accept-rate", "1.0"], ["--prefill-tokens-per-s", "1"],
     ["--prefill-tokens-per-s", "nan"], ["--decode-step-s", "inf"]]
)  # fmt: skip


def run_case(geo: str, wl: str, cost: list[str]) -> tuple[int, str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "g.toml").write_text(geo)
        (Path(tmp) / "w.jsonl").write_text(wl)
        argv = ["simulate", f"{tmp}/g.toml", f"{tmp}/w.jsonl", "--out", f"{tmp}/o"]
        argv += ["--quiet", "--no-plots", "--no-compare", "--json", *cost]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                with time_limit(CASE_LIMIT_S):
                    rc = main(argv)
            except SystemExit as exc:  # argparse: a usage error
                rc = int(exc.code or 0)
        if rc in (0, 1):
            summary = json.loads((Path(tmp) / "o" / "summary.json").read_text())
            assert json.loads(out.getvalue()) == summary
        return rc, out.getvalue(), err.getvalue()


@settings(
    max_examples=scaled(NUM_CASES),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(geo=geometry(), wl=workload(), cost=COST)
def test_every_generated_case_ends_with_results_or_one_clear_error(
    geo: str, wl: str, cost: list[str]
) -> None:
    started = time.monotonic()
    rc, _, err = run_case(geo, wl, cost)
    assert time.monotonic() - started < CASE_LIMIT_S
    lines = err.splitlines()
    assert "Traceback" not in err
    if rc == 0:
        assert lines == []
    elif rc == 1:  # the run finished; requests that can never fit are named (and, when the
        # attention pages alone show it, were said to be before the run)
        if len(lines) == 2:
            assert " can never fit " in lines.pop(0), lines
        assert len(lines) == 1 and " the cache (capacity " in lines[0], lines
    else:
        assert rc == 2, (rc, err)
        assert len(lines) == 1 and lines[0].startswith("kvreuse simulate: "), lines
