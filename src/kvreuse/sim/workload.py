"""Workload files (JSONL, one request per line), read by `kvreuse simulate`.

A line:

    {"id": "t3", "prompt": PROMPT, "max_tokens": 16, "arrival": 0.5, "after": "t2",
     "cache_salt": "tenant-a", "lora": ["fr", "/adapters/fr"]}

    PROMPT = {"tokens": [1, 2, 3]}                   literal token ids
           | {"random": {"seed": 7, "len": 2048}}    deterministic pseudo-random tokens
           | {"concat": [PROMPT, ...]}               concatenation
           | {"history": "t2"}                       t2's prompt + its generated tokens (t2 must
                                                     finish first: an implicit "after")
           | {"blocks": {"ids": [7, 9], "block_tokens": 512, "len": 700}}
                                                     a trace's hashed blocks: block_tokens tokens
                                                     per id (`block_tokens`), cut to len

A blocks prompt stays compact until the request reaches the scheduler, so a trace of 145 M
prompt tokens is a few megabytes of workload.

Only `id`, `prompt` and `max_tokens` are required. Unknown fields are errors, never ignored;
every error names the line and the field.
"""

from __future__ import annotations

import array
import functools
import hashlib
import random
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreuse.core.spi import TOKEN_TYPECODE
from kvreuse.sim.jsonl import LineError, json_lines

FIELDS = {"id", "prompt", "max_tokens", "arrival", "after", "cache_salt", "lora"}
VOCAB = 1 << 15  # random prompts' token ids lie in [0, VOCAB)
# A bound on a random prompt's length and on max_tokens: 16,777,216 tokens (a 64 MB prompt)
# is past any model's context; larger values are typos that would exhaust memory or time.
MAX_TOKENS_PER_REQUEST = 1 << 24
MAX_BLOCK_TOKENS = 1 << 16  # tokens per hashed block of a trace (Mooncake 512, Bailian 16)
MAX_BLOCK_ID = 1 << 32  # a block id is the first token of its block: a 4-byte token word
# The latest arrival, in seconds (about 136 years: Unix times fit). Past 2**33 s a float's step
# is coarser than the microsecond that arrivals are written to.
MAX_ARRIVAL_S = 1 << 32
PROMPT_KINDS = ("tokens", "random", "concat", "history", "blocks")


class WorkloadError(ValueError):
    """A workload line is malformed; the message names the line and the field."""


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    request_id: str
    prompt: Any  # the PROMPT tree, validated; resolve with `resolve_prompt`
    max_tokens: int
    arrival: float = 0.0
    after: str | None = None
    cache_salt: str | None = None
    lora: tuple[str, str] | None = None

    def histories(self) -> set[str]:
        """Ids whose tokens this prompt quotes with {"history": id}."""
        return set(_histories(self.prompt))

    def dependencies(self) -> set[str]:
        deps = set(_histories(self.prompt))
        if self.after is not None:
            deps.add(self.after)
        return deps


def random_tokens(seed: int, length: int) -> list[int]:
    return _random_tokens(seed, length).tolist()


@functools.lru_cache(maxsize=256)
def _random_tokens(seed: int, length: int) -> array.array[int]:
    """Memoised: a shared system prompt is generated once, not once per request.

    Every step runs in C (a per-token Python loop cost more than the rest of a simulation's
    prompt handling): token = low byte | (high byte & 0x7F) << 8, uniform in [0, VOCAB),
    built as little-endian 4-byte words. Callers copy it (`tokens_of` concatenates).
    """
    rng = random.Random(seed)
    low, high = rng.randbytes(length), rng.randbytes(length).translate(_HIGH_7_BITS)
    words = bytearray(4 * length)
    words[0::4], words[1::4] = low, high
    out = array.array(TOKEN_TYPECODE, words)
    if sys.byteorder != "little":
        out.byteswap()  # the same tokens on every machine
    return out


_HIGH_7_BITS = bytes(b & 0x7F for b in range(256))
_BLOCK_DOMAIN = b"kvreuse/trace-block/"


def block_tokens(block_id: int, length: int) -> array.array[int]:
    """The first `length` tokens of hashed block `block_id`: a fixed function of (id, position).

    Token 0 is the id itself, so blocks of different ids differ at their first token, and since
    every unit's digest chains over all the tokens before it, prompts sharing a leading run of
    ids share exactly those tokens and digests, whatever the cache's page or hash unit. Token
    j ≥ 1 is the j-th little-endian 4-byte word of SHAKE-128(domain), the same in every block:
    a block costs a copy, not a hash of its own. A shorter block is a prefix of a longer one,
    so a prompt's partial last block matches the start of the full block."""
    return array.array(TOKEN_TYPECODE, _block(block_id, length))


@functools.cache
def _filler() -> bytes:
    """Every block's words 0 … MAX_BLOCK_TOKENS − 1 in native order (word 0 is overwritten by
    the id): 256 KiB, drawn once per process."""
    out = array.array(TOKEN_TYPECODE, hashlib.shake_128(_BLOCK_DOMAIN).digest(4 * MAX_BLOCK_TOKENS))
    if sys.byteorder != "little":
        out.byteswap()  # the same tokens on every machine
    return out.tobytes()


def _block(block_id: int, length: int) -> bytes:
    return block_id.to_bytes(4, sys.byteorder) + _filler()[4 : 4 * length]


def _blocks_tokens(value: Mapping[str, Any]) -> array.array[int]:
    ids, size, length = value["ids"], value["block_tokens"], value["len"]
    whole, rest = divmod(length, size)
    order, tail = sys.byteorder, _filler()[4 : 4 * size]
    parts = [block_id.to_bytes(4, order) + tail for block_id in ids[:whole]]
    if rest:
        parts.append(_block(ids[whole], rest))
    return array.array(TOKEN_TYPECODE, b"".join(parts))


def resolve_prompt(prompt: Any, history: Mapping[str, Sequence[int]]) -> list[int]:
    """Token ids of a validated PROMPT; `history[id]` is a finished request's full tokens."""
    return tokens_of(prompt, history).tolist()


def tokens_of(prompt: Any, history: Mapping[str, Sequence[int]]) -> array.array[int]:
    """`resolve_prompt` as a fresh 4-byte unsigned array: the core takes it without a
    per-token check (docs/decisions.md D14), and concatenation runs in C."""
    kind, value = next(iter(prompt.items()))
    if kind == "random":
        return _random_tokens(value["seed"], value["len"])[:]
    if kind == "concat":
        out = array.array(TOKEN_TYPECODE)
        for part in value:
            out += tokens_of(part, history)
        return out
    if kind == "blocks":
        return _blocks_tokens(value)
    return array.array(TOKEN_TYPECODE, value if kind == "tokens" else history[value])


def _histories(prompt: Any) -> Iterator[str]:
    kind, value = next(iter(prompt.items()))
    if kind == "history":
        yield value
    elif kind == "concat":
        for part in value:
            yield from _histories(part)


def _check_prompt(prompt: Any, where: str) -> None:
    if not isinstance(prompt, dict) or len(prompt) != 1:
        raise WorkloadError(
            f"{where}: a prompt is an object with exactly one of "
            "'tokens', 'random', 'concat', 'history'"
        )
    kind, value = next(iter(prompt.items()))
    if kind == "tokens":
        if not isinstance(value, list) or not all(type(t) is int and 0 <= t < 2**32 for t in value):
            raise WorkloadError(f"{where}.tokens: a list of ints in [0, 2**32)")
    elif kind == "random":
        if (
            not isinstance(value, dict)
            or set(value) != {"seed", "len"}
            or not all(type(value[k]) is int for k in ("seed", "len"))
            or not 0 <= value["len"] <= MAX_TOKENS_PER_REQUEST
        ):
            raise WorkloadError(
                f'{where}.random: {{"seed": int, "len": int in 0 … {MAX_TOKENS_PER_REQUEST:,}}}'
            )
    elif kind == "concat":
        if not isinstance(value, list) or not value:
            raise WorkloadError(f"{where}.concat: a non-empty list of prompts")
        for i, part in enumerate(value):
            _check_prompt(part, f"{where}.concat[{i}]")
    elif kind == "history":
        if not isinstance(value, str) or not value:
            raise WorkloadError(f"{where}.history: the id of an earlier request")
    elif kind == "blocks":
        _check_blocks(value, f"{where}.blocks")
    else:
        raise WorkloadError(
            f"{where}: unknown prompt kind {kind!r}; use one of {', '.join(PROMPT_KINDS)}"
        )


def _check_blocks(value: Any, where: str) -> None:
    shape = (
        f'{{"ids": [ints in [0, 2**32)], "block_tokens": int in 1 … {MAX_BLOCK_TOKENS:,}, '
        '"len": int}'
    )
    if not isinstance(value, dict) or set(value) != {"ids", "block_tokens", "len"}:
        raise WorkloadError(f"{where}: {shape}")
    ids, size, length = value["ids"], value["block_tokens"], value["len"]
    if not isinstance(ids, list) or not ids:
        raise WorkloadError(f"{where}.ids: a non-empty list of block ids (ints in [0, 2**32))")
    bad = [x for x in ids if type(x) is not int or not 0 <= x < MAX_BLOCK_ID]
    if bad:
        raise WorkloadError(f"{where}.ids: block ids are ints in [0, 2**32), got {bad[0]!r}")
    if type(size) is not int or not 1 <= size <= MAX_BLOCK_TOKENS:
        raise WorkloadError(
            f"{where}.block_tokens: an int in 1 … {MAX_BLOCK_TOKENS:,}, got {size!r}"
        )
    limit = min(len(ids) * size, MAX_TOKENS_PER_REQUEST)
    if type(length) is not int or not 1 <= length <= limit:
        raise WorkloadError(
            f"{where}.len: an int in 1 … {limit:,} (len(ids) × block_tokens, at most "
            f"{MAX_TOKENS_PER_REQUEST:,}), got {length!r}"
        )


def _compact(prompt: Any) -> Any:
    """A validated PROMPT with every blocks prompt's ids as a 4-byte array (not a list of
    Python ints: 4 bytes an id instead of about 36)."""
    kind, value = next(iter(prompt.items()))
    if kind == "blocks":
        ids = array.array(TOKEN_TYPECODE, value["ids"])
        return {"blocks": {**value, "ids": ids}}
    if kind == "concat":
        return {"concat": [_compact(p) for p in value]}
    return prompt


def parse_line(obj: Any, lineno: int) -> WorkloadRequest:
    where = f"line {lineno}"
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - FIELDS
    if unknown:
        raise WorkloadError(
            f"{where}: unknown field(s) {sorted(unknown)}; allowed: {sorted(FIELDS)}"
        )
    for name in ("id", "prompt", "max_tokens"):
        if name not in obj:
            raise WorkloadError(f"{where}: missing field {name!r}")
    rid = obj["id"]
    if not isinstance(rid, str) or not rid:
        raise WorkloadError(f"{where}: field 'id' must be a non-empty string")
    _check_prompt(obj["prompt"], f"{where}: field 'prompt'")
    max_tokens = obj["max_tokens"]
    if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_TOKENS_PER_REQUEST:
        raise WorkloadError(
            f"{where}: field 'max_tokens' must be an int in 1 … {MAX_TOKENS_PER_REQUEST:,}, "
            f"got {max_tokens!r}"
        )
    arrival = _seconds(obj.get("arrival", 0.0))
    if arrival is None:
        raise WorkloadError(
            f"{where}: field 'arrival' must be a finite number of seconds in 0 … "
            f"{MAX_ARRIVAL_S:,} (2**32), got {obj['arrival']!r}"
        )
    after = obj.get("after")
    if after is not None and (not isinstance(after, str) or not after):
        raise WorkloadError(f"{where}: field 'after' must be a request id")
    salt = obj.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise WorkloadError(f"{where}: field 'cache_salt' must be a string")
    lora = obj.get("lora")
    if lora is not None:
        if (
            not isinstance(lora, list)
            or len(lora) != 2
            or not all(isinstance(x, str) for x in lora)
        ):
            raise WorkloadError(f"{where}: field 'lora' must be [name, path]")
        lora = (lora[0], lora[1])
    return WorkloadRequest(rid, _compact(obj["prompt"]), max_tokens, arrival, after, salt, lora)


def _seconds(value: Any) -> float | None:
    """`value` as seconds in [0, MAX_ARRIVAL_S], or None (NaN and Infinity, which Python's JSON
    reader accepts, and integers too large for a float are refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        seconds = float(value)
    except OverflowError:
        return None
    return seconds if 0 <= seconds <= MAX_ARRIVAL_S else None


def load_workload(lines: Iterable[str | bytes]) -> list[WorkloadRequest]:
    """Parse and cross-check a JSONL workload (unique ids; references to earlier ids only)."""
    return load_objects(json_lines(lines))


def load_objects(objects: Iterable[tuple[int, Any]]) -> list[WorkloadRequest]:
    """`load_workload` of (line number, decoded line) pairs."""
    out: list[WorkloadRequest] = []
    seen: set[str] = set()
    try:
        for lineno, obj in objects:
            req = parse_line(obj, lineno)
            if req.request_id in seen:
                raise WorkloadError(f"line {lineno}: field 'id': duplicate id {req.request_id!r}")
            missing = sorted(req.dependencies() - seen)
            if missing:
                raise WorkloadError(
                    f"line {lineno}: refers to {missing}, which no earlier line "
                    "defines ('after' and 'history' name earlier requests)"
                )
            seen.add(req.request_id)
            out.append(req)
    except LineError as exc:
        raise WorkloadError(str(exc)) from None
    return out


def read_workload(path: Path) -> list[WorkloadRequest]:
    """`load_workload` of a JSONL file, read line by line (never whole); every failure, an
    unreadable or empty file included, is a WorkloadError naming the file."""
    try:
        with path.open("rb") as lines:  # decoded line by line, so a bad byte names its line
            workload = load_workload(lines)
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read the workload file ({exc.strerror})") from None
    except WorkloadError as exc:
        raise WorkloadError(f"{path}: {exc}") from None
    if not workload:
        raise WorkloadError(f"{path}: no requests (write one with kvreuse workload KIND)")
    return workload
