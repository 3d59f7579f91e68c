"""The front's view of a store its replicas share (`kvreuse serve --store-shared`).

Replicas in several processes keep one store equal by a journal of its changes in Redis
(kvreuse.serve.store_turns): each takes a step as a turn and pushes what it changed. The
front reads the same journal, so its `StoreMirror` (kvreuse.events.mirror), which every
replica's mirror lists as a shared tier, holds the keys the store holds after the last turn:

    journal ["place", 7, g, keys] ──► index[g][key] = 7 for keys no slot indexes yet ─► mirror
            ["take", 7]           ──► keys slot 7 indexed leave the index            ─► mirror
            ["extend", 7, keys]   ──► the slot's later keys join it                  ─► mirror
            ["touch", 7]          ──► nothing a lookup reads (the store's LRU order)

The index follows the core's rule (kvreuse.core.tiers.Tier): a key belongs to the first slot
that indexed it, and leaves with that slot only. Before each decision the dispatcher calls
`sync()`; a replica's next turn replays exactly the entries the front has read, so a request
routed while no other replica changes the store finds the store the front predicted from.
A journal that cannot be read leaves the view as it was (counted in `num_errors`, logged
once): a decision is then made on an older store, never refused. An entry that does not fit
the view (a slot it never placed) means the view cannot be trusted: it is emptied and the
front stops following (`broken`), so it predicts no store hits rather than wrong ones.
"""

from __future__ import annotations

import logging
from typing import Any

from kvreuse.events import StoreMirror
from kvreuse.events.wire import low64
from kvreuse.serve.store_turns import decode

log = logging.getLogger("kvreuse.fleet")

Keys = list[tuple[int, bytes]]


class StoreFollower:
    """Keeps `mirror` equal to the store whose journal is the Redis list `journal_key`."""

    def __init__(self, client: Any, journal_key: str, mirror: StoreMirror) -> None:
        self.client, self.journal_key, self.mirror = client, journal_key, mirror
        self.slots: dict[int, tuple[int, Keys]] = {}  # slot → (group id, keys)
        self.index: list[dict[bytes, int]] = [{} for _ in mirror.index]  # key → slot
        self.cursor = 0  # journal entries applied
        self.num_errors = 0
        self.last_error: str | None = None
        self.broken: str | None = None

    def sync(self) -> int:
        """Apply the journal's new entries; returns how many there were."""
        if self.broken is not None:
            return 0
        try:
            entries = self.client.lrange(self.journal_key, self.cursor, -1)
        except Exception as exc:  # the store's client raises its own errors; none may escape
            self.num_errors += 1
            if self.last_error is None:
                log.warning("cannot read the shared store's journal (%s): routing on the "
                            "store as last read", exc)  # fmt: skip
            self.last_error = str(exc)
            return 0
        self.last_error = None
        for raw in entries:
            try:
                self.apply(decode(raw))
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                self._break(f"journal entry {self.cursor}: {exc!r}")
                return 0
            self.cursor += 1
        return len(entries)

    def _break(self, why: str) -> None:
        log.error("the shared store's journal does not fit the front's view (%s): no longer "
                  "predicting store hits", why)  # fmt: skip
        self.broken = why
        self.mirror.clear()

    def apply(self, changes: list[tuple[Any, ...]]) -> None:
        """One journal entry's changes, in order."""
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
                self.slots.clear()
                for idx in self.index:
                    idx.clear()
                self.mirror.clear()
            elif op != "touch":
                raise ValueError(f"the shared store's journal holds an unknown change {op!r}")

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

    from kvreuse.core import TierSpec
    from kvreuse.serve.options import serve_parser
    from kvreuse.sim.args import HOST_TIER, STORE_TIER

    opts, _ = serve_parser(argparse.ArgumentParser).parse_known_args(serve_args)
    media = [
        TierSpec(name, 1, medium="CPU" if name == HOST_TIER else "").medium
        for name, tokens in ((HOST_TIER, opts.host_capacity), (STORE_TIER, opts.store_capacity))
        if tokens is not None
    ]
    return media, opts.store_url if opts.store_shared else None


def follow_replicas(dispatcher: Any, urls: list[str], store_url: str) -> StoreFollower:
    """Follow the store the replicas at `urls` share (each names its journal at
    /kvreuse/store); ValueError in one line when one names none, or another."""
    import httpx
    import redis

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
    client = redis.Redis.from_url(store_url, socket_timeout=5, socket_connect_timeout=5)
    follower = StoreFollower(client, journals.pop(), dispatcher.store)
    dispatcher.follow_store(follower)
    return follower
