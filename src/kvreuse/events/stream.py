"""One replica's KV event stream as a subscriber follows it: what is applied, and whether the
mirror is exact.

The live stream (SUB) only makes claims; the replay socket, which the subscriber dials at the
replica's own address, answers for the replica. A live batch is applied when it carries the next
number, decodes and fits the geometry (a forged batch at the next number is found out when the
real one arrives: the same number with other bytes). One already applied (it came through a
replay first) is recognised by its digest and dropped. Anything else, a number ahead (lost
batches, or a forged number), a number below with other bytes (a restarted replica numbering
from 0 again, or a forged copy), a payload that does not decode or fit, is dropped and marks the
stream `suspect`: the subscriber then checks it through the replay, once per poll.

A check asks for everything from the last applied batch (the anchor) on:

    applied:  … 41 42 43          next_seq = 44, anchor = 43
    answer:   note(instance, next_seq = 46)  43 44 45
                                              ^^ the anchor's very bytes, same instance:
                                                 44 and 45 are applied
    answer:   note(other instance, 2)  0 1      a restart: the mirror is rebuilt from batch 0
    answer:   note(…)  50 51 …                   the anchor is gone: rebuilt from 0 if held

When the answer does not start with the anchor's bytes, or names another instance, the stream
followed is not the publisher's: the mirror is cleared and rebuilt from batch 0, exact again if
the replay still holds every batch from 0 (always, for a replica restarted lately). A batch
numbered past what the publisher says it has sent is rejected and changes nothing.

`exact`: the mirror holds exactly what batches 0…next_seq−1 of the followed incarnation say,
and nothing waits to be checked. A batch lost for good (no replay, or a buffer that moved on)
clears it until the mirror is rebuilt (a restart) or cleared by an `AllBlocksCleared`.
Without a replay endpoint nothing can be checked: a number below is taken for a restart (the
mirror is cleared, exact if it is 0), a number ahead for a loss.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import zmq

from kvreuse.events.curve import KeyPair, dial
from kvreuse.events.mirror import MirrorError, ReplicaMirror
from kvreuse.events.replay import NOTE_SEQ, ReplayEnd, decode_end
from kvreuse.events.wire import AllBlocksCleared, PayloadError, decode_batch

log = logging.getLogger(__name__)

RECENT_DIGESTS = 4096  # applied batches whose digests tell a duplicate from a conflict
MAX_ERRORS = 100
MAX_CHECK_ROUNDS = 64  # answers cut short by the publisher's byte bound, asked again
NO_ANSWER_PAUSE_S = 5.0  # after a replay did not answer, poll() checks again only this late
# A message larger than this ends the connection it came on (ZeroMQ's MAXMSGSIZE): a batch of
# a 2-million-token prefill is about 10 MiB.
MAX_MESSAGE_BYTES = 256 << 20


def digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


@dataclass
class Answer:
    """A replay's batches, in the order received, and the publisher's note (None from vLLM,
    which has none)."""

    batches: list[tuple[int, bytes]]
    note: ReplayEnd | None


@dataclass
class ReplicaStream:
    """One replica's sockets, position in its stream, and what went wrong with it."""

    name: str
    mirror: ReplicaMirror
    sub: zmq.Socket[bytes]
    replay: zmq.Socket[bytes] | None
    replay_endpoint: str | None = None
    replay_timeout: float = 2.0
    next_seq: int = 0
    instance: str | None = None  # the publisher incarnation followed, once a replay named it
    lost: bool = False
    suspect: bool = False
    num_batches: int = 0
    num_gaps: int = 0
    num_replayed: int = 0
    num_unrepaired: int = 0
    num_bad_payloads: int = 0
    num_restarts: int = 0
    num_rejected: int = 0
    errors: list[str] = field(default_factory=list)
    recent: OrderedDict[int, bytes] = field(default_factory=OrderedDict, repr=False)
    held: OrderedDict[tuple[int, bytes], None] = field(default_factory=OrderedDict, repr=False)
    paused_until: float = 0.0  # poll() leaves a replay that did not answer alone until then
    check_from: int | None = None  # the earliest applied batch a live one contradicted
    curve: tuple[str, KeyPair] | None = None  # the publisher's public key, our client pair
    check_requests: int = 0  # checks asked for from outside (`request_check`)

    @property
    def exact(self) -> bool:
        return not (self.lost or self.suspect)

    # ------------------------------------------------------------------ live batches
    def receive(self, frames: list[bytes]) -> int:
        """A message from the SUB socket; returns batches applied."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.num_rejected += 1
            self.error(f"a message of {len(frames)} frames is not a KV event batch")
            return 0
        seq, payload = int.from_bytes(frames[1], "big"), frames[2]
        if seq == self.next_seq:
            if self._apply(seq, payload):
                return 1
            if self.replay is None:
                return 0
        elif seq < self.next_seq:
            applied = self.recent.get(seq)
            if applied == digest(payload):
                return 0  # applied already, through a replay
            if self.replay is None:
                return self._restarted_unchecked(seq, payload)
            if applied is not None:  # the same number with other bytes: check from there
                self.check_from = min(
                    seq, self.next_seq if self.check_from is None else self.check_from
                )
        else:
            self.num_gaps += 1
            if self.replay is None:
                self._lose(seq, "no replay endpoint")
                return int(self._apply(seq, payload))
        self.suspect = True  # checked through the replay at the end of the poll
        self.held[(seq, digest(payload))] = None
        if len(self.held) > RECENT_DIGESTS:
            self.held.popitem(last=False)
        return 0

    def _restarted_unchecked(self, seq: int, payload: bytes) -> int:
        self.num_restarts += 1
        self.error(f"batch {seq} after {self.next_seq - 1}: taken for a restart (no replay)")
        self._reset()
        self.next_seq = seq
        self.lost = seq != 0
        return int(self._apply(seq, payload))

    # ------------------------------------------------------------------ replay checks
    def request_check(self) -> None:
        """Check the stream through the replay at the next chance (it may have restarted); a
        check under way when this is asked keeps the stream suspect."""
        self.suspect = True
        self.check_requests += 1

    def check(self, hold: AbstractContextManager[object] | None = None) -> int:
        """Check the stream against the replay and apply what it holds past the anchor;
        returns batches applied. A replay that does not answer, or is busy, leaves the stream
        as it was (still suspect, if it was).

        `hold` (a lock) is held for everything but the waits for the replay's answers, so a
        reader that takes it (a router reading the mirror) never waits for the network. The
        caller keeps live batches of this stream out until the check returns: an answer is
        read against the position the stream had when it was asked."""
        hold = hold if hold is not None else contextlib.nullcontext()
        with hold:
            requests = self.check_requests
        applied, rebuilt = 0, False
        for _ in range(MAX_CHECK_ROUNDS):
            with hold:
                anchor = self.next_seq - 1
                if self.check_from is not None:
                    anchor = min(anchor, self.check_from)
            answer = self.ask(max(anchor, 0))
            with hold:
                step = self._take_answer(answer, anchor, rebuilt)
                if step is None:
                    return applied
                more, rebuilt, count = step
                applied += count
            if not more:
                break
        with hold:
            # a check asked for meanwhile (another incarnation named) is still owed
            self.suspect = self.check_requests != requests
            self.check_from = None
            self._settle_held()
        return applied

    def _take_answer(
        self, answer: Answer | None, anchor: int, rebuilt: bool
    ) -> tuple[bool, bool, int] | None:
        """One replay answer: (ask again, rebuilt, batches applied), or None when there was
        no usable answer (the stream stays as it was)."""
        if answer is None or (answer.note is not None and answer.note.busy):
            self.paused_until = time.monotonic() + NO_ANSWER_PAUSE_S
            return None
        if not self._continues(answer, anchor):
            if rebuilt:  # not even batch 0 on: give up until the next check
                self.lost = True
                return False, True, 0
            self._rebuild()
            return True, True, 0
        if answer.note is not None:
            self.instance = answer.note.instance
        applied = self._apply_run(answer.batches)
        more = answer.note is not None and self.next_seq < answer.note.next_seq
        return more, rebuilt, applied

    def _continues(self, answer: Answer, anchor: int) -> bool:
        """Whether the answer continues the stream followed: the same incarnation, no fewer
        batches, the anchor first (past batch 0), and the very bytes applied for every batch
        up to the last one applied."""
        end = answer.note
        if end is not None and self.instance is not None and end.instance != self.instance:
            return False
        if end is not None and end.next_seq < self.next_seq:
            return False
        if anchor < 0:
            return True
        if not answer.batches or answer.batches[0][0] != anchor:
            return False
        recent = self.recent
        for seq, payload in answer.batches:
            if seq >= self.next_seq:
                break
            if digest(payload) != recent.get(seq):
                return False
        return True

    def _rebuild(self) -> None:
        """The stream followed is not the publisher's: start again from batch 0."""
        self.num_restarts += 1
        self.error(f"the replica's stream no longer continues batch {self.next_seq - 1}: rebuilt")
        self._reset()

    def restart(self) -> None:
        """The publisher is known to be a new process: start again from batch 0 at once,
        suspect until the replay confirms the new incarnation (its batches received meanwhile
        are checked then)."""
        self.num_restarts += 1
        self._reset()
        self.held.clear()
        if self.replay is not None:  # without one there is nothing to check against
            self.request_check()
            self.paused_until = 0.0

    def _settle_held(self) -> None:
        """Live batches dropped before the check: those the publisher never sent are rejected."""
        for seq, dig in self.held:
            if self.recent.get(seq) != dig:
                self.num_rejected += 1
        self.held.clear()

    def _reset(self) -> None:
        self.mirror.clear()
        self.recent.clear()
        self.next_seq, self.lost, self.instance, self.check_from = 0, False, None, None

    def _apply_run(self, batches: list[tuple[int, bytes]]) -> int:
        applied = 0
        for seq, payload in batches:
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                self._lose(seq, "the replay buffer moved on")
            if self._apply(seq, payload):
                applied += 1
                self.num_replayed += 1
            else:  # the replica's own batch is unusable: lost for good
                self._lose(seq + 1, "a replayed batch could not be applied")
        return applied

    def _lose(self, resume: int, why: str) -> None:
        self.num_unrepaired += 1
        self.lost = True
        self.error(f"batches {self.next_seq}…{resume - 1} are lost ({why})")
        self.next_seq = resume

    def _apply(self, seq: int, payload: bytes) -> bool:
        try:
            events = decode_batch(payload).events
            self.mirror.check(events)
        except (PayloadError, MirrorError) as exc:
            self.num_bad_payloads += 1
            self.error(f"batch {seq}: {exc}")
            return False
        try:
            self.mirror.apply(events)
        except Exception:  # a bug, not the replica's doing; the mirror may be half-changed
            log.exception("KV events of replica %s: batch %d broke the mirror", self.name, seq)
            self.lost = True
        if any(isinstance(ev, AllBlocksCleared) for ev in events):
            self.lost = False  # the mirror is empty, as the replica is: exact from here on
        self.next_seq = seq + 1
        self.num_batches += 1
        self.recent[seq] = digest(payload)
        if len(self.recent) > RECENT_DIGESTS:
            self.recent.popitem(last=False)
        return True

    # ------------------------------------------------------------------ the replay socket
    def ask(self, start: int) -> Answer | None:
        """The publisher's note and every batch the replay holds from `start` on, or None when
        it does not answer in time (the socket is then replaced, so a late answer cannot mix
        with the next). Both requests go at once; their answers come back in order."""
        sock = self.replay
        if sock is None:
            return None
        sock.send_multipart((b"", NOTE_SEQ.to_bytes(8, "big")))
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        batches: list[tuple[int, bytes]] = []
        note: ReplayEnd | None = None
        ends = 0
        deadline = time.monotonic() + self.replay_timeout
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not sock.poll(left_ms):
                self.error(f"the replay did not answer in {self.replay_timeout:g} s")
                self.replace_replay()
                return None
            frames = sock.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                self.error(f"a replay message of {len(frames)} frames was ignored")
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq >= 0:
                batches.append((seq, frames[3]))
            elif ends == 0:  # the note request's end (vLLM's is empty)
                note, ends = decode_end(frames[3]), 1
            else:
                return Answer(batches, note)

    def replace_replay(self, endpoint: str | None = None) -> None:
        """A new DEALER for the replay, at `endpoint` (default: where the old one dialled)."""
        where = endpoint or self.replay_endpoint
        if where is None:
            return
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self.curve is not None:
            dial(sock, *self.curve)
        try:
            sock.connect(where)
        except zmq.ZMQError as exc:
            sock.close(linger=0)
            raise ValueError(f"replica {self.name!r}: replay endpoint {where}: {exc}") from None
        if self.replay is not None:
            self.replay.close(linger=0)
        self.replay, self.replay_endpoint = sock, where

    def error(self, message: str) -> None:
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(message)
        log.warning("KV events of replica %s: %s", self.name, message)

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)
