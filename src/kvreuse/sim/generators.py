"""Workload generators: `kvreuse workload KIND [options] > FILE.jsonl`.

Every generator returns the JSON objects of `kvreuse.sim.workload`, deterministic in its seed.
Prompts are described, not materialised ({"random": {"seed", "len"}}), so files stay small.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from kvreuse.deployment import DeploymentSpec, resolve

Line = dict[str, Any]


def _rand(seed: int, length: int) -> dict[str, Any]:
    return {"random": {"seed": seed, "len": length}}


def _positive(**values: int) -> None:
    for name, v in values.items():
        if type(v) is not int or v < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer ≥ 1, got {v!r}")


def resend_grid(
    lengths: Sequence[int], extra: int = 8, max_tokens: int = 1, seed: int = 0
) -> list[Line]:
    """Per length: a cold request, an identical warm resend, then the prompt plus `extra`.

    One request at a time (each waits for the one before): a request's TTFT is then its own
    prefill, not the queue behind other lengths' cold prompts, so warm and cold compare."""
    if not lengths:
        raise ValueError("--lengths needs at least one length")
    _positive(extra=extra, max_tokens=max_tokens)
    bad = [n for n in lengths if type(n) is not int or n < 1]
    if bad:
        raise ValueError(f"--lengths: every length must be an integer ≥ 1, got {bad}")
    out: list[Line] = []
    for n in lengths:
        base = _rand(seed * 1_000_003 + n, n)
        cold: Line = {"id": f"cold-{n}", "prompt": base, "max_tokens": max_tokens}
        if out:
            cold["after"] = out[-1]["id"]
        out.append(cold)
        out.append(
            {"id": f"warm-{n}", "prompt": base, "max_tokens": max_tokens, "after": f"cold-{n}"}
        )
        out.append(
            {
                "id": f"appended-{n}",
                "prompt": {"concat": [base, _rand(seed * 1_000_003 + n + 7_919, extra)]},
                "max_tokens": max_tokens,
                "after": f"warm-{n}",
            }
        )
    return out


def shared_prefix(
    prefix_len: int, suffix_len: int, requests: int, max_tokens: int = 1, seed: int = 0
) -> list[Line]:
    """`requests` requests arriving together, sharing one `prefix_len`-token system prompt."""
    _positive(
        prefix_len=prefix_len, suffix_len=suffix_len, requests=requests, max_tokens=max_tokens
    )
    prefix = _rand(seed, prefix_len)
    return [
        {
            "id": f"p{i}",
            "prompt": {"concat": [prefix, _rand(seed + 1 + i, suffix_len)]},
            "max_tokens": max_tokens,
            "arrival": 0.0,
        }
        for i in range(requests)
    ]


def agent(
    sessions: int, turns: int, user_len: int, tool_len: int, max_tokens: int, seed: int = 0
) -> list[Line]:
    """Multi-turn agents: every turn's prompt is the previous turn's history (prompt plus
    generated tokens) followed by a tool result and a user message."""
    _positive(
        sessions=sessions, turns=turns, user_len=user_len, tool_len=tool_len, max_tokens=max_tokens
    )
    out: list[Line] = []
    for s in range(sessions):
        for t in range(turns):
            rid = f"s{s}-t{t}"
            s_seed = (seed * 1_000_003 + s) * 1_000 + t
            if t == 0:
                prompt: dict[str, Any] = _rand(s_seed, user_len)
            else:
                prompt = {
                    "concat": [
                        {"history": f"s{s}-t{t - 1}"},
                        _rand(s_seed, tool_len),
                        _rand(s_seed + 500, user_len),
                    ]
                }
            out.append({"id": rid, "prompt": prompt, "max_tokens": max_tokens})
    return out


def retrieval(length: int, max_tokens: int = 16, seed: int = 0) -> list[Line]:
    """One long document, cold, then warm."""
    _positive(length=length, max_tokens=max_tokens)
    doc = _rand(seed, length)
    return [
        {"id": "doc-cold", "prompt": doc, "max_tokens": max_tokens},
        {"id": "doc-warm", "prompt": doc, "max_tokens": max_tokens, "after": "doc-cold"},
    ]


def fill_sequences(geometry: DeploymentSpec, length: int, factor: float = 1.5) -> int:
    """Sequences of `length` tokens whose cached pages fill `factor` × the geometry's pool."""
    cfg = resolve(geometry).cache
    groups = cfg.geometry.groups
    # what a finished sequence leaves cached: its attention pages and one state per recurrent group
    per = sum(-(-length // g.page_size) if g.is_attention else 1 for g in groups)
    return max(1, math.ceil(factor * (cfg.num_blocks - 1) / per))


def pressure(
    sequences: int | None,
    length: int,
    repeats: int,
    max_tokens: int = 1,
    seed: int = 0,
    geometry: DeploymentSpec = "hybrid-dcp4",
) -> list[Line]:
    """Fill the cache with long sequences, one after another, then replay them, each pass in
    the reverse order of the one before (`repeats` passes in all): a replay first finds the
    newest sequences cached and then the ones evicted. `sequences=None`: enough to fill
    1.5 × `geometry`'s pool."""
    if sequences is None:
        _positive(length=length)
        sequences = fill_sequences(geometry, length)
    _positive(sequences=sequences, length=length, repeats=repeats, max_tokens=max_tokens)
    out: list[Line] = []
    prev: str | None = None
    for r in range(repeats):
        for j in range(sequences) if r % 2 == 0 else reversed(range(sequences)):
            line: Line = {
                "id": f"q{j}-r{r}",
                "prompt": _rand(seed * 1_000_003 + j, length),
                "max_tokens": max_tokens,
            }
            if prev is not None:
                line["after"] = prev
            out.append(line)
            prev = line["id"]
    return out


# Each takes its options as keywords (`kvreuse workload KIND --option ...`).
GENERATORS: dict[str, Callable[..., list[Line]]] = {
    "resend-grid": resend_grid,
    "shared-prefix": shared_prefix,
    "agent": agent,
    "retrieval": retrieval,
    "pressure": pressure,
}
