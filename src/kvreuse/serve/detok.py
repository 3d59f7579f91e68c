"""Incremental detokenisation with stop strings.

Rules (streamed and non-streamed answers run the same code, so their text is equal):

* The answer ends before the stop string that completes first (the one ending earliest in the
  text; of those, the longest).
* Stop strings are matched only in *settled* text: the decoded tokens minus a trailing
  incomplete UTF-8 sequence, whose U+FFFD placeholder may still become a real character. A stop
  string containing U+FFFD therefore matches an invalid byte, never a character in progress.
* Text is emitted only when no stop string can still begin in it: the last (longest stop − 1)
  settled characters are held back, so a stream never shows part of a stop string that arrives
  split across tokens, and never has to take text back.
* When the request ends, the held-back text is released; a trailing incomplete sequence
  becomes U+FFFD (the answer really ends there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvreuse.tokenizer import ByteTokenizer, Tokenizer


@dataclass(slots=True)
class TextState:
    stops: tuple[str, ...]
    text: str = ""  # emitted so far
    stopped: bool = False


def _incomplete_tail(data: bytes) -> int:
    """Length of a trailing UTF-8 sequence that more bytes could still complete (0 to 3)."""
    for back in range(1, min(3, len(data)) + 1):
        tail = data[-back:]
        if tail[0] & 0xC0 != 0x80:  # the first byte that is not a continuation byte
            return back if _unfinished(tail) else 0
    return 0


def _unfinished(tail: bytes) -> bool:
    try:
        tail.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start == 0 and exc.reason == "unexpected end of data"
    return False


def settled(tokenizer: Tokenizer, ids: Sequence[int]) -> tuple[str, str]:
    """(settled text, tail): the tail is a trailing incomplete sequence, decoded as it is now
    (U+FFFD), which stop strings never match."""
    if isinstance(tokenizer, ByteTokenizer):
        data = bytes(i for i in ids if 0 <= i < 256)
        cut = len(data) - _incomplete_tail(data)
        return data[:cut].decode("utf-8", errors="replace"), data[cut:].decode(
            "utf-8", errors="replace"
        )
    # Other tokenizers: trailing placeholders are taken for characters in progress.
    full = tokenizer.decode(list(ids))
    head = full.rstrip("\ufffd")
    return head, full[len(head) :]


def advance(tokenizer: Tokenizer, st: TextState, ids: Sequence[int], finished: bool) -> str:
    """The new text since the last call; sets `st.stopped` when a stop string matched."""
    head, tail = settled(tokenizer, ids)
    # the stop string that completes first ends the answer, however the tokens were grouped
    # into deltas: the smallest end, then the smallest start
    hits = []
    for s in st.stops:
        i = head.find(s, max(0, len(st.text) - len(s) + 1))
        if i >= 0:
            hits.append((i + len(s), i))
    if hits:
        full, st.stopped = head[: min(hits)[1]], True
    elif finished:
        full = head + tail
    else:
        keep = max((len(s) for s in st.stops), default=1) - 1
        full = head[: max(len(st.text), len(head) - keep)]
    new = full[len(st.text) :]
    st.text = full
    return new
