"""JSON lines as the workload and trace readers take them: one value a line, every failure a
`LineError` naming the line and what is allowed.

Python's JSON reader alone would fail three ways without naming the line: a value nested a
few thousand levels deep is a RecursionError (and one nested a few hundred deep would be one
later, in the recursive checks of a prompt or in the repr of an error message), an integer of
more than `sys.get_int_max_str_digits()` digits a ValueError, and a file read as text stops
at a byte that is not UTF-8 without saying on which line. So lines are read as bytes, decoded
one by one, and their nesting is bounded before they are parsed.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Any

# A workload line nests about 2 levels per concat of prompts and a trace record 2 in all; 100
# is far past either, and far below where a recursive reader or check runs out of stack.
MAX_DEPTH = 100
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string: brackets in it do not nest
_BRACKET = re.compile(r"[\[{\]}]")


class LineError(ValueError):
    """A line is not a JSON value the readers take; the message starts with 'line N: '."""


def json_lines(lines: Iterable[bytes | str]) -> Iterator[tuple[int, Any]]:
    """(line number, value) of every line that is not blank, numbered from 1."""
    for lineno, raw in enumerate(lines, 1):
        if isinstance(raw, bytes):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise LineError(
                    f"line {lineno}: not UTF-8 text (byte {exc.start + 1} of the line)"
                ) from None
        else:
            text = raw
        if text.strip():
            yield lineno, parse(text, lineno)


def parse(text: str, lineno: int) -> Any:
    """One line's JSON value (LineError naming `lineno` if it has none the readers take)."""
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth(text) > MAX_DEPTH:
        raise LineError(
            f"line {lineno}: nested deeper than {MAX_DEPTH} levels (a line may hold at most "
            f"{MAX_DEPTH} levels of arrays and objects)"
        )
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise LineError(f"line {lineno}: not valid JSON ({exc.msg})") from None
    except ValueError:  # the only other error of the reader: an integer past the digit limit
        digits = sys.get_int_max_str_digits()
        raise LineError(
            f"line {lineno}: an integer of more than {digits:,} digits (a line may hold "
            f"integers of at most {digits:,} digits; no field takes one nearly as large)"
        ) from None


def _depth(text: str) -> int:
    """The deepest nesting of arrays and objects in `text`, outside its strings. It stops
    counting past MAX_DEPTH, so a line of a million brackets costs little."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        if m[0] in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    break
        else:
            depth -= 1
    return deepest
