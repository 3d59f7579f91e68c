"""The front's view of a store its replicas share (`kvreuse serve --store-shared`).

Replicas in several processes keep one store equal by a log of its changes in Redis
(kvreuse.serve.store_turns): each takes a step as a turn and pushes what it changed. The
front reads the same view (its epoch, the snapshot, the entries after it), so its
`StoreMirror` (kvreuse.events.mirror), which every replica's mirror lists as a shared tier,
holds the keys the store holds after the last turn:

    ["place", 7, g, keys] ──► index[g][key] = 7 for keys no slot indexes yet ─► mirror
    ["take", 7]           ──► keys slot 7 indexed leave the index            ─► mirror
    ["extend", 7, keys]   ──► the slot's later keys join it                  ─► mirror
    ["touch", 7]          ──► nothing a lookup reads (the store's LRU order)

The index follows the core's rule (kvreuse.core.tiers.tier.Tier): a key belongs to the first slot
that indexed it, and leaves with that slot only. Before each decision the dispatcher reads the
view (`fetch()`, I/O only) and applies it (`apply_fetched()`, memory only). `exact` says whether
the view is complete and current as of that read: after a read that failed, an epoch that
changed, a log that went back or lost entries the front had not read, or an entry that does
not fit, it is False until the view is rebuilt from the snapshot (the next read does it), and
the front marks no store prediction exact meanwhile.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kvreuse.events import StoreMirror
from kvreuse.events.wire import low64
from kvreuse.serve.store_view import (
    StoreKeys,
    View,
    decode_state,
    entries_after,
    entry_seq,
    read_view,
)

log = logging.getLogger("kvreuse.fleet")

Keys = list[tuple[int, bytes]]


@dataclass
class Fetched:
    """One read of the view: the entries after the front's, or a snapshot and the entries
    after it when the front must rebuild; `error` when the read failed."""

    view: View | None
    snapshot: bytes | None = None
    rebuild: bool = False
    error: str | None = None


class StoreFollower:
    """Keeps `mirror` equal to the shared store whose log is the Redis stream `log_key`."""

    def __init__(self, client: Any, log_key: str, mirror: StoreMirror) -> None:
        self.client, self.mirror = client, mirror
        self.keys = StoreKeys(log_key.removeprefix("kvreuse:").removesuffix(":log"))
        self.journal_key = log_key
        self.slots: dict[int, tuple[int, Keys]] = {}  # slot → (group id, keys)
        self.index: list[dict[bytes, int]] = [{} for _ in mirror.index]  # key → slot
        self.epoch: str | None = None
        self.seq = -1
        self.exact = False
        self.num_errors = self.num_rebuilds = 0
        self.last_error: str | None = None

    @property
    def view(self) -> str | None:
        """The view the mirror holds, as a replica names the one it admitted a request on
        (`STORE_VIEW_HEADER`): "<epoch>:<seq>"; None while not exact."""
        return f"{self.epoch}:{self.seq}" if self.exact else None

    @property
    def broken(self) -> str | None:
        return None if self.exact else (self.last_error or "not read yet")

    def sync(self) -> int:
        """Read the view and apply it; returns how many entries were applied."""
        return self.apply_fetched(self.fetch())

    def fetch(self) -> Fetched:
        """The I/O of a sync; never raises."""
        try:
            view = read_view(self.client, self.keys, self.seq)
            if view.epoch is None:
                return Fetched(view)
            first = entry_seq(view.entries[0][0]) if view.entries else view.seq + 1
            behind = view.epoch != self.epoch or view.seq < self.seq or first != self.seq + 1
            if not behind:
                return Fetched(view)
            snap = self.client.get(self.keys.snap)
            if snap is not None:
                _, snap_seq, _ = decode_state(snap)
                view = read_view(self.client, self.keys, snap_seq)
            return Fetched(view, snap, rebuild=True)
        except Exception as exc:  # the store's client raises its own errors; none may escape
            return Fetched(None, error=f"{type(exc).__name__}: {exc}")

    def apply_fetched(self, got: Fetched) -> int:
        """The memory part of a sync."""
        if got.view is None or got.view.epoch is None:
            why = got.error or "the store holds no view yet"
            self._inexact(why, clear=got.error is None)
            return 0
        view = got.view
        try:
            if got.rebuild:
                self._rebuild(view, got.snapshot)
            applied = self._apply_entries(view)
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            self._inexact(f"the view does not fit: {exc!r}", clear=True)
            return 0
        self.exact, self.last_error = True, None
        return applied

    def _inexact(self, why: str, *, clear: bool) -> None:
        self.num_errors += 1
        if self.last_error != why:
            log.warning("shared store %s: %s; store predictions are not exact until it is "
                        "read again", self.keys.ns, why)  # fmt: skip
        self.exact, self.last_error = False, why
        if clear:
            self._clear()
            self.epoch, self.seq = None, -1

    def _rebuild(self, view: View, snapshot: bytes | None) -> None:
        self.num_rebuilds += 1
        self._clear()
        if snapshot is None:
            raise ValueError("no snapshot to rebuild from")
        epoch, seq, state = decode_state(snapshot)
        if epoch != view.epoch:
            raise ValueError("the snapshot is of another view")
        for slot, gid, keys in state.slots:
            self.slots[slot] = (gid, [(b, k) for b, k, _ in keys])
            self._index(slot, gid, [(b, k) for b, k, indexed in keys if indexed])
        self.epoch, self.seq = epoch, seq

    def _apply_entries(self, view: View) -> int:
        applied = 0
        for changes in entries_after(view.entries, self.seq, view.seq):
            self.apply(changes)
            self.seq += 1
            applied += 1
        self.epoch = view.epoch
        return applied

    def _clear(self) -> None:
        self.slots.clear()
        for idx in self.index:
            idx.clear()
        self.mirror.clear()

    def apply(self, changes: list[tuple[Any, ...]]) -> None:
        """One log entry's changes, in order."""
        for op, *args in changes:
            if op == "place":
                slot, gid, keys = args
                self.slots[slot] = (gid, list(keys))
                self._index(slot, gid, keys)
            elif op == "take":
                gid, keys = self.slots.pop(args[0])
                idx, gone = self.index[gid], []
                for _, key in keys:
                    if idx.get(key) == args[0]:
                        del idx[key]
                        gone.append(key)
                entries = self.mirror.entries(gid)
                for h in low64(gone):
                    entries.pop(h, None)
            elif op == "extend":
                slot, keys = args
                gid = self.slots[slot][0]
                self.slots[slot] = (gid, list(keys))
                self._index(slot, gid, keys)
            elif op == "clear":
                self._clear()
            elif op != "touch":
                raise ValueError(f"the shared store's log holds an unknown change {op!r}")

    def _index(self, slot: int, gid: int, keys: Keys) -> None:
        idx = self.index[gid]
        new = [key for _, key in keys if key not in idx]
        for key in new:
            idx[key] = slot
        self.mirror.entries(gid).update(dict.fromkeys(low64(new), 0))


def replica_tiers(serve_args: list[str]) -> tuple[list[str], str | None]:
    """The media of the tiers `kvreuse serve SERVE_ARGS` keeps, in order, and the URL of the
    store it shares with the other replicas (None when it shares none)."""
    import argparse

    from kvreuse.serve.options import serve_parser
    from kvreuse.tiering import tier_media

    opts, _ = serve_parser(argparse.ArgumentParser).parse_known_args(serve_args)
    media = tier_media(opts.host_capacity, opts.store_capacity)
    return media, opts.store_url if opts.store_shared else None


def follow_replicas(dispatcher: Any, urls: list[str], store_url: str) -> StoreFollower:
    """Follow the store the replicas at `urls` share (each names its journal at
    /kvreuse/store); ValueError in one line when one names none, or another."""
    import httpx

    from kvreuse.serve.store_view import redis_client

    assert dispatcher.store is not None
    journals = set()
    for url in urls:
        try:
            resp = httpx.get(f"{url}/kvreuse/store", timeout=5.0)
        except httpx.HTTPError as exc:
            raise ValueError(f"{url}/kvreuse/store did not answer ({exc})") from None
        if resp.status_code != 200:
            raise ValueError(f"{url} shares no store (GET /kvreuse/store: {resp.status_code})")
        info = resp.json()
        if info.get("media") != list(dispatcher.tiers):
            raise ValueError(f"{url} keeps the tiers {info.get('media')}, not "
                             f"{list(dispatcher.tiers)} as the front expected")  # fmt: skip
        journals.add(info["journal"])
    if len(journals) != 1:
        raise ValueError(f"the replicas do not share one store: journals {sorted(journals)}")
    client = redis_client(store_url, 2.0)
    follower = StoreFollower(client, journals.pop(), dispatcher.store)
    dispatcher.follow_store(follower)
    return follower
