"""Public request traces as workloads: `kvreuse workload import FORMAT FILE`.

Two formats, one JSON record a line:

    mooncake   {"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}
               (Mooncake's FAST'25 traces: 512-token blocks, ids chained over the prefix)
    bailian    {"chat_id": n, "parent_chat_id": n | -1, "timestamp": s, "input_length": n,
                "output_length": n, "type": "text", "turn": n, "hash_ids": [...]}
               (Alibaba Bailian's Qwen traces: 16-token blocks)

Each record becomes one workload line whose prompt is a `blocks` prompt (the workload format's
compact form: ids, tokens per block, length), so the importer reads a line and writes a line,
and the tokens are built only when the simulator hands the request to the scheduler. Tokens
past the last id (`input_length` > ids × block tokens) are the trace's unknown content: a
`random` prompt seeded by the record's line, shared with no other request. A Bailian request
whose parent was written waits for it (`after`); its prompt holds the parent's blocks, so the
parent's cached prompt is reused.

Every bad record stops the import with one line naming the file, the line and the field.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvreuse.sim.jsonl import LineError, json_lines
from kvreuse.sim.workload import (
    MAX_ARRIVAL_S,
    MAX_BLOCK_ID,
    MAX_BLOCK_TOKENS,
    MAX_TOKENS_PER_REQUEST,
    WorkloadError,
    WorkloadRequest,
    load_objects,
    read_workload,
)
from kvreuse.vocab import number, plural


@dataclass(frozen=True)
class TraceFormat:
    name: str
    fields: tuple[str, ...]  # every record has exactly these
    block_tokens: int  # the default tokens per hash id
    seconds_per_tick: float  # the timestamp's unit
    tick: str  # its name


FORMATS = {
    "mooncake": TraceFormat(
        "mooncake", ("timestamp", "input_length", "output_length", "hash_ids"), 512, 1e-3, "ms"
    ),
    "bailian": TraceFormat(
        "bailian",
        (
            "chat_id",
            "parent_chat_id",
            "timestamp",
            "input_length",
            "output_length",
            "type",
            "turn",
            "hash_ids",
        ),
        16,
        1.0,
        "s",
    ),
}


@dataclass(frozen=True)
class ImportOptions:
    block_tokens: int | None = None  # None: the format's
    limit: int | None = None  # requests written, at most
    time_scale: float = 1.0  # arrival = timestamp × scale (0.5: twice the request rate)
    sample: float = 1.0  # fraction of requests (Bailian: of sessions) kept
    seed: int = 0  # of the sample


@dataclass
class ImportStats:
    """What an import read and wrote, for the closing line on stderr."""

    num_records: int = 0
    num_written: int = 0
    prompt_tokens: int = 0
    num_past_ids: int = 0  # records with tokens past their last hash id
    num_no_output: int = 0  # output_length 0, generating one token
    num_orphans: int = 0  # Bailian requests written whose parent chat id was not seen before

    def summary(self, verb: str = "wrote") -> str:
        lines = [
            f"{verb} {plural(self.num_written, 'request')} ({self.prompt_tokens:,} prompt tokens) "
            f"from {plural(self.num_records, 'record')}"
        ]
        if self.num_past_ids:
            lines.append(
                f"{plural(self.num_past_ids, 'record')} "
                f"{'has' if self.num_past_ids == 1 else 'have'} more input tokens than its hash "
                "ids cover; "
                "those tokens are unique to their request (shared with none)"
            )
        if self.num_no_output:
            lines.append(
                f"{plural(self.num_no_output, 'record')} "
                f"{'has' if self.num_no_output == 1 else 'have'} output_length 0; each generates "
                "1 token "
                "(a request generates at least one)"
            )
        if self.num_orphans:
            lines.append(
                f"{plural(self.num_orphans, 'request')} "
                f"{'names' if self.num_orphans == 1 else 'name'} a parent_chat_id no earlier "
                "record has (a session begun before the trace); "
                f"{'it waits' if self.num_orphans == 1 else 'they wait'} for no one"
            )
        return "; ".join(lines)


def _where(name: str, lineno: int, key: str | None = None) -> str:
    return f"{name}: line {lineno}" + (f": field {key!r}" if key else "")


def _int(rec: dict[str, Any], key: str, low: int, high: int, at: tuple[str, int]) -> int:
    value = rec[key]
    if type(value) is not int or not low <= value <= high:
        raise WorkloadError(
            f"{_where(*at, key)} must be an int in {low:,} … {high:,}, got {_short(value)}"
        )
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _timestamp(rec: dict[str, Any], at: tuple[str, int]) -> float:
    value = rec["timestamp"]
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    if ok:
        try:
            ok = 0 <= float(value) < math.inf
        except OverflowError:
            ok = False
    if not ok:
        raise WorkloadError(
            f"{_where(*at, 'timestamp')} must be a finite number ≥ 0, got {_short(value)}"
        )
    return float(value)


def _hash_ids(rec: dict[str, Any], at: tuple[str, int]) -> list[int]:
    ids = rec["hash_ids"]
    if not isinstance(ids, list):
        raise WorkloadError(f"{_where(*at, 'hash_ids')} must be a list of ints, got {_short(ids)}")
    bad = [x for x in ids if type(x) is not int or not 0 <= x < MAX_BLOCK_ID]
    if bad:
        raise WorkloadError(
            f"{_where(*at, 'hash_ids')} must hold ints in [0, 2**32), got {_short(bad[0])}"
        )
    return ids


def _record(fmt: TraceFormat, obj: Any, at: tuple[str, int]) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{_where(*at)}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in fmt.fields if k not in obj]
    if missing:
        raise WorkloadError(
            f"{_where(*at)}: missing field(s) {missing}; a {fmt.name} record has {list(fmt.fields)}"
        )
    unknown = sorted(set(obj) - set(fmt.fields))
    if unknown:
        raise WorkloadError(
            f"{_where(*at)}: unknown field(s) {unknown}; a {fmt.name} record has {list(fmt.fields)}"
        )
    rec = {
        "timestamp": _timestamp(obj, at),
        "input_length": _int(obj, "input_length", 1, MAX_TOKENS_PER_REQUEST, at),
        "output_length": _int(obj, "output_length", 0, MAX_TOKENS_PER_REQUEST, at),
        "hash_ids": _hash_ids(obj, at),
    }
    if fmt.name == "bailian":
        rec["chat_id"] = _int(obj, "chat_id", 0, 2**63 - 1, at)
        rec["parent_chat_id"] = _int(obj, "parent_chat_id", -1, 2**63 - 1, at)
        kind = obj["type"]
        if not isinstance(kind, str) or not kind.strip():
            raise WorkloadError(f"{_where(*at, 'type')} must be a non-empty string")
        rec["type"] = kind
        _int(obj, "turn", 0, 2**63 - 1, at)
    return rec


def prompt_of(ids: list[int], length: int, block_tokens: int, seed: int) -> dict[str, Any]:
    """The workload PROMPT of a record: its blocks cut to `length`, and past the last id
    `length − ids × block_tokens` tokens shared with no other request (`seed` is the record's)."""
    covered = min(length, len(ids) * block_tokens)
    parts: list[dict[str, Any]] = []
    if covered:
        used = ids[: -(-covered // block_tokens)]
        parts.append({"blocks": {"ids": used, "block_tokens": block_tokens, "len": covered}})
    if covered < length:
        parts.append({"random": {"seed": seed, "len": length - covered}})
    return parts[0] if len(parts) == 1 else {"concat": parts}


def _kept(seed: int, key: int, fraction: float) -> bool:
    """A deterministic coin: (seed, key) → kept with probability `fraction`."""
    if fraction >= 1.0:
        return True
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") < fraction * 2**64


def import_trace(
    fmt_name: str,
    lines: Iterable[bytes | str],
    name: str,
    options: ImportOptions,
    stats: ImportStats | None = None,
) -> Iterator[dict[str, Any]]:
    """Workload lines (dicts) of the trace's records, one per record kept, as they are read.

    Mooncake's requests are sampled one by one (by line), Bailian's by session: a child is kept
    with its parent, so a session is whole or absent. Bailian keeps the chat ids it has seen
    (about 100 bytes each); nothing else grows with the trace."""
    fmt = FORMATS[fmt_name]
    size = options.block_tokens or fmt.block_tokens
    if not 1 <= size <= MAX_BLOCK_TOKENS:
        raise WorkloadError(f"--block-tokens must be in 1 … {MAX_BLOCK_TOKENS:,}, got {size}")
    stats = stats if stats is not None else ImportStats()
    sessions: dict[int, str | None] = {}  # Bailian: chat id → its request id (None: dropped)
    records = json_lines(lines)
    while options.limit is None or stats.num_written < options.limit:  # (read no further)
        try:
            lineno, obj = next(records)
        except StopIteration:
            return
        except LineError as exc:
            raise WorkloadError(f"{name}: {exc}") from None
        at = (name, lineno)
        rec = _record(fmt, obj, at)
        stats.num_records += 1
        out: dict[str, Any] = {"arrival": _arrival(rec["timestamp"], fmt, options, at)}
        if fmt.name == "bailian":
            rid = _bailian_id(rec, sessions, options, stats, at, out)
            if rid is None:
                continue
        else:
            if not _kept(options.seed, lineno, options.sample):
                continue
            rid = f"r{lineno}"
        yield _line(rid, rec, size, lineno, stats, out)


def _arrival(
    timestamp: float, fmt: TraceFormat, options: ImportOptions, at: tuple[str, int]
) -> float:
    """The record's arrival in seconds, at most the workload format's MAX_ARRIVAL_S."""
    arrival = timestamp * fmt.seconds_per_tick * options.time_scale
    if not arrival <= MAX_ARRIVAL_S:  # (an overflow to inf included)
        raise WorkloadError(
            f"{_where(*at, 'timestamp')}: {timestamp:g} {fmt.tick} × --time-scale "
            f"{options.time_scale:g} is an arrival of {arrival:g} s; arrivals must be at most "
            f"{MAX_ARRIVAL_S:,} s (2**32, about 136 years): use a smaller --time-scale"
        )
    return round(arrival, 6)


def _bailian_id(
    rec: dict[str, Any],
    sessions: dict[int, str | None],
    options: ImportOptions,
    stats: ImportStats,
    at: tuple[str, int],
    out: dict[str, Any],
) -> str | None:
    """The request id of a Bailian record (None: sampled out), and its `after` in `out`."""
    chat_id, parent = rec["chat_id"], rec["parent_chat_id"]
    if chat_id in sessions:
        raise WorkloadError(f"{_where(*at, 'chat_id')}: duplicate chat_id {chat_id}")
    rid: str | None = f"{rec['type']}-{chat_id}"
    if parent in sessions:  # a later turn goes with the session of the turn it continues
        after = sessions[parent]
        if after is None:
            rid = None
        else:
            out["after"] = after
    elif not _kept(options.seed, chat_id, options.sample):
        rid = None  # a root (or a turn whose parent precedes the trace) starts a session
    elif parent != -1:
        stats.num_orphans += 1
    sessions[chat_id] = rid
    return rid


def _line(
    rid: str,
    rec: dict[str, Any],
    size: int,
    lineno: int,
    stats: ImportStats,
    extra: dict[str, Any],
) -> dict[str, Any]:
    length, ids = rec["input_length"], rec["hash_ids"]
    if length > len(ids) * size:
        stats.num_past_ids += 1
    if rec["output_length"] == 0:
        stats.num_no_output += 1
    line: dict[str, Any] = {
        "id": rid,
        "prompt": prompt_of(ids, length, size, lineno),
        "max_tokens": max(1, rec["output_length"]),
        **extra,  # arrival, and a Bailian turn's after
    }
    stats.num_written += 1
    stats.prompt_tokens += length
    return line


def read_trace(
    path: Path, fmt_name: str, options: ImportOptions
) -> tuple[list[WorkloadRequest], ImportStats]:
    """The workload `kvreuse workload import FORMAT FILE` would write, read in this process (as
    `kvreuse simulate --trace` and `kvreuse sweep --trace` do): no file in between, and every
    line checked as a workload line is. A failure is a WorkloadError naming the file."""
    stats = ImportStats()
    try:
        with path.open("rb") as lines:
            records = import_trace(fmt_name, lines, str(path), options, stats)
            workload = load_objects(enumerate(records, 1))
    except OSError as exc:
        raise WorkloadError(f"{path}: cannot read the trace ({exc.strerror})") from None
    if not workload:
        raise WorkloadError(f"{path}: no records")
    return workload, stats


def add_trace_options(p: argparse.ArgumentParser) -> None:
    """`--trace FORMAT` and `--time-scale X`: the workload file is a public trace, imported in
    this process as `kvreuse workload import FORMAT` would (docs/traces.md)."""
    p.add_argument(
        "--trace",
        choices=sorted(FORMATS),
        default=None,
        metavar="FORMAT",
        help="the workload file is a trace in this format (mooncake, bailian), imported as "
        "kvreuse workload import FORMAT would, with its defaults",
    )
    add_time_scale(p, None, "with --trace: ")


def add_time_scale(p: Any, default: float | None, when: str = "") -> None:
    """`--time-scale X`: a trace's arrival times multiplied by X (`ImportOptions.time_scale`);
    `default` None: absent unless given (`simulate` and `sweep`, where it needs --trace)."""
    p.add_argument(
        "--time-scale",
        type=number(0, 1e6),
        default=default,
        metavar="X",
        help=f"{when}multiply arrival times by X (0.5: twice the request rate; 0: all at once)",
    )


def read_workload_arg(path: Path, args: argparse.Namespace, prog: str) -> list[WorkloadRequest]:
    """The workload in `path`: a workload JSONL file, or with --trace a trace imported here (its
    import line, as the import command prints it, on stderr unless --quiet). A WorkloadError
    names what was wrong."""
    fmt, scale = getattr(args, "trace", None), getattr(args, "time_scale", None)
    if fmt is None:
        if scale is not None:
            raise WorkloadError("--time-scale applies to a trace: give --trace FORMAT with it")
        return read_workload(path)
    workload, stats = read_trace(
        path, fmt, ImportOptions(time_scale=1.0 if scale is None else scale)
    )
    if not getattr(args, "quiet", False):
        print(f"{prog}: {path}: {stats.summary('imported')}", file=sys.stderr)
    return workload
