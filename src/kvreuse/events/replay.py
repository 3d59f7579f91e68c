"""The replay socket: vLLM's protocol, the publisher's bounded answers, and the publisher's note.

A request is `[b"", start_seq]` (8 bytes, unsigned big-endian) from a DEALER; the answer is
every buffered batch from `start_seq` on as `[b"", topic, seq, payload]`, then the end marker
`[b"", b"", -1, b""]`, byte for byte as vLLM sends them (Dynamo's consumer, for one, takes
anything else there for a broken replay).

One request is kvreuse's own: `start_seq` = 2⁶⁴−1 (`NOTE_SEQ`, a number no batch can carry, so
vLLM answers it with its end marker alone). kvreuse's publisher answers it with an end marker
whose last frame is its note, `ReplayEnd` (msgpack `[instance, next_seq, busy]`): which
incarnation of the publisher answered (a random id per `Publisher`, so a subscriber can tell a
restarted replica from the one it followed), the number its next batch will carry (so an answer
cut short, or a batch numbered past it, shows), and whether a batch request now would find every
answer slot taken. A subscriber sends the note request and its batch request together; the two
answers come back in that order.

Bounds, so a replay client cannot cost the publisher unbounded memory or time: at most
`max_clients` answers in progress (more get the end marker at once, with no batches), each at
most `max_bytes` of payload (the client asks again from where it got to) and `deadline_s`
seconds; the ROUTER holds at most `hwm` messages per client (a client that stops reading is
found when its pipe is full, and its answer is dropped at the deadline). So a connected client
that never reads pins at most `hwm` messages (copies of buffered batches), and its answer ends
within `deadline_s`; clients told busy pin nothing.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import msgspec
import zmq

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
NOTE_SEQ = (1 << 64) - 1  # the start of kvreuse's note request
DEFAULT_MAX_CLIENTS = 4
DEFAULT_MAX_BYTES = 16 << 20
DEFAULT_DEADLINE_S = 5.0
DEFAULT_HWM = 256
_PUMP_MESSAGES = 256  # messages one answer sends per turn of the publisher's loop


class ReplayEnd(msgspec.Struct, array_like=True, frozen=True):
    """kvreuse's note: the publisher that answered, its next number, whether it is busy."""

    instance: str
    next_seq: int
    busy: bool = False


_END_ENCODER = msgspec.msgpack.Encoder()
_END_DECODER = msgspec.msgpack.Decoder(ReplayEnd)


def encode_end(end: ReplayEnd) -> bytes:
    return _END_ENCODER.encode(end)


def decode_end(note: bytes) -> ReplayEnd | None:
    """The note in an end marker, or None (vLLM's empty last frame, or anything unreadable)."""
    if not note:
        return None
    try:
        return _END_DECODER.decode(note)
    except (msgspec.DecodeError, RecursionError):
        return None


@dataclass
class _Answer:
    client: bytes
    next_seq: int  # the next batch this answer sends
    deadline: float
    sent_bytes: int = 0


class ReplayServer:
    """The publisher's side of the replay socket; only the publisher's thread calls it."""

    def __init__(
        self,
        sock: zmq.Socket[bytes],
        topic: bytes,
        instance: str,
        *,
        max_clients: int = DEFAULT_MAX_CLIENTS,
        max_bytes: int = DEFAULT_MAX_BYTES,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        self.sock = sock
        self.topic = topic
        self.instance = instance
        self.max_clients = max_clients
        self.max_bytes = max_bytes
        self.deadline_s = deadline_s
        self.answers: dict[bytes, _Answer] = {}
        self.num_busy = 0  # requests told busy
        self.num_abandoned = 0  # answers dropped at their deadline (the client did not read)

    def serve(self, buffer: deque[tuple[int, bytes]], next_seq: int) -> None:
        """Take new requests, then move every answer in progress on."""
        while self.sock.poll(0):
            self._request(self.sock.recv_multipart(), next_seq)
        now = time.monotonic()
        for answer in list(self.answers.values()):
            if self._pump(answer, buffer, next_seq):
                del self.answers[answer.client]
            elif now > answer.deadline:
                del self.answers[answer.client]
                self.num_abandoned += 1
                log.warning("a replay client did not read its answer in time: dropped")

    @property
    def busy(self) -> bool:
        return bool(self.answers)

    def _request(self, frames: list[bytes], next_seq: int) -> None:
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignored a malformed replay request of %d frames", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        full = client not in self.answers and len(self.answers) >= self.max_clients
        if start == NOTE_SEQ:
            note = encode_end(ReplayEnd(self.instance, next_seq, full))
            self._end(client, note)
            return
        if full:
            self.num_busy += 1
            self._end(client)
            return
        # a client asking again replaces its answer in progress
        self.answers[client] = _Answer(client, start, time.monotonic() + self.deadline_s)

    def _pump(self, answer: _Answer, buffer: deque[tuple[int, bytes]], next_seq: int) -> bool:
        """Send what the client's pipe takes; True once the answer has ended."""
        first = buffer[0][0] if buffer else next_seq
        for _ in range(_PUMP_MESSAGES):
            seq = max(answer.next_seq, first)
            if seq >= next_seq or answer.sent_bytes >= self.max_bytes:
                return self._end(answer.client)
            payload = buffer[seq - first][1]
            frames = (answer.client, b"", self.topic, seq.to_bytes(8, "big"))
            try:
                self.sock.send_multipart((*frames, payload), flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False  # its pipe is full: try again on a later turn
            except zmq.ZMQError:
                return True  # the client is gone
            answer.next_seq = seq + 1
            answer.sent_bytes += len(payload)
        return False

    def _end(self, client: bytes, note: bytes = b"") -> bool:
        try:
            self.sock.send_multipart((client, b"", b"", END_SEQ, note), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError:
            pass
        return True
