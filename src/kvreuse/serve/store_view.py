"""The format of a shared store's view in Redis and how it is read (kvreuse.serve.store_turns
writes it; the replicas and the fleet's front read it): change entries, snapshots, the keys of
a namespace, and a client that keeps the password out of sight."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvreuse.core.spi import TierState


# ------------------------------------------------------------------------------ encoding
def encode(changes: list[tuple[Any, ...]]) -> str:
    out: list[list[Any]] = []
    for change in changes:
        op, *args = change
        if op == "place":
            slot, gid, keys = args
            out.append([op, slot, gid, [[b, k.hex()] for b, k in keys]])
        elif op == "extend":
            out.append([op, args[0], [[b, k.hex()] for b, k in args[1]]])
        else:
            out.append([op, *args])
    return json.dumps(out, separators=(",", ":"))


def decode(raw: bytes | str) -> list[tuple[Any, ...]]:
    """An entry's changes; ValueError for anything that is not one (a poisoned entry)."""
    try:
        out: list[tuple[Any, ...]] = []
        for op, *args in json.loads(raw):
            if op == "place":
                slot, gid, keys = args
                out.append((op, int(slot), int(gid), [(int(b), bytes.fromhex(k)) for b, k in keys]))
            elif op == "extend":
                out.append((op, int(args[0]), [(int(b), bytes.fromhex(k)) for b, k in args[1]]))
            elif op in ("take", "touch"):
                out.append((op, int(args[0])))
            elif op == "clear" and not args:
                out.append((op,))
            else:
                raise ValueError(f"unknown change {op!r}")
        return out
    except (TypeError, ValueError, AttributeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not a change entry ({exc})") from None


def encode_state(epoch: str, seq: int, state: TierState) -> str:
    slots = [[s, g, [[b, k.hex(), int(i)] for b, k, i in keys]] for s, g, keys in state.slots]
    return json.dumps({"epoch": epoch, "seq": seq, "slots": slots, "free": state.free},
                      separators=(",", ":"))  # fmt: skip


def decode_state(raw: bytes | str) -> tuple[str, int, TierState]:
    """(epoch, seq, state) of a snapshot; ValueError for anything that is not one."""
    try:
        doc = json.loads(raw)
        slots = [
            (int(s), int(g), [(int(b), bytes.fromhex(k), bool(i)) for b, k, i in keys])
            for s, g, keys in doc["slots"]
        ]
        return str(doc["epoch"]), int(doc["seq"]), TierState(slots, [int(f) for f in doc["free"]])
    except (TypeError, ValueError, KeyError, AttributeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not a snapshot ({exc})") from None


@dataclass(frozen=True)
class StoreKeys:
    """The Redis keys of one namespace's shared view (module docstring)."""

    ns: str

    def __getattr__(self, name: str) -> str:
        if name in ("turn", "fence", "epoch", "seq", "log", "snap", "logbytes", "meta"):
            return f"kvreuse:{self.ns}:{name}"
        raise AttributeError(name)

    def view(self) -> list[str]:
        return [self.turn, self.epoch, self.seq, self.log, self.snap, self.logbytes]


@dataclass(frozen=True)
class View:
    """What one read of the store's view found."""

    epoch: str | None
    seq: int
    entries: list[Any]  # (id, fields) with seq above the reader's
    log_bytes: int  # entries' bytes since the snapshot
    snap_bytes: int


def read_view(client: Any, keys: StoreKeys, after: int) -> View:
    """The view past entry `after`, in one round trip."""
    pipe = client.pipeline(transaction=True)
    pipe.get(keys.epoch).get(keys.seq).xrange(keys.log, min=f"{after + 1}-0", max="+")
    pipe.get(keys.logbytes).strlen(keys.snap)
    epoch, seq, entries, log_bytes, snap_bytes = pipe.execute()
    return View(epoch.decode() if epoch is not None else None, int(seq or -1), entries,
                int(log_bytes or 0), int(snap_bytes or 0))  # fmt: skip


def entries_after(entries: list[Any], after: int, upto: int) -> Iterator[list[tuple[Any, ...]]]:
    """The changes of each entry of `entries` (as XRANGE gives them) after entry `after`, in
    order; ValueError where one is missing (trimmed), does not decode, or the log does not
    reach `upto`: the reader's view then cannot follow from where it is."""
    expect = after + 1
    for entry_id, fields in entries:
        seq = entry_seq(entry_id)
        if seq != expect:
            raise ValueError(f"entries {expect}..{seq - 1} are gone")
        yield decode(fields.get(b"e", fields.get("e")))
        expect += 1
    if expect - 1 != upto:
        raise ValueError(f"the log ends at {expect - 1}, not {upto}")


def entry_seq(entry_id: bytes | str) -> int:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-")[0])


PASSWORD_ENV = "KVREUSE_STORE_PASSWORD"


def redacted(url: str) -> str:
    """`url` without its password, for messages and logs."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
    except ValueError:  # not a URL at all: whatever follows "@" may still be a secret
        return "***@" + url.rsplit("@", 1)[-1] if "@" in url else url
    host = parts.netloc.rsplit("@", 1)[-1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


def redis_client(url: str, timeout_s: float) -> Any:
    """A client of the server at `url`, with the password from `KVREUSE_STORE_PASSWORD` when
    the url has none (so it need not show in `ps`)."""
    import redis

    kwargs: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if urlsplit(url).password is None and os.environ.get(PASSWORD_ENV):
        kwargs["password"] = os.environ[PASSWORD_ENV]
    return redis.Redis.from_url(url, **kwargs)
