"""The canonical encoding of hashed values (spec §5.3) and the token word format.

``enc`` is tagged and length-prefixed, so no two distinct values share bytes: ``("ab", "c")``
and ``("a", "bc")`` differ, and so do a salt and a LoRA name with the same text.

    None 0x00 | int 0x01 + 8 bytes (int64) | bytes 0x02 + u64 length + bytes
    str 0x03 + u64 length + UTF-8 | tuple/list 0x04 + u64 count + items | tokens 0x05 + u64
    count + 4-byte big-endian words
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_LITTLE = sys.byteorder == "little"
# The 4-byte unsigned array typecode: tokens are hashed, validated (request.py) and built (the
# simulator's prompts) as such arrays.
TOKEN_TYPECODE = "I" if array("I").itemsize == 4 else "L"
assert array(TOKEN_TYPECODE).itemsize == 4


class TokenArray(tuple[int, ...]):
    """Token ids that ``enc`` writes as a token array (tag 0x05, 4 bytes per token).

    A marker type rather than "any list of ints", so that a tuple of ints and a token array
    holding the same ints can never encode alike.
    """

    __slots__ = ()

    def __new__(cls, tokens: Sequence[int] = ()) -> TokenArray:
        self = super().__new__(cls, tokens)
        for t in self:
            if type(t) is bool or not isinstance(t, int):
                raise TypeError(f"token must be int, got {type(t).__name__}")
            if not 0 <= t < 2**32:
                raise ValueError(f"token {t} out of range [0, 2**32)")
        return self


def u64(n: int) -> bytes:
    return n.to_bytes(8, "big")


def tok_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as 4-byte big-endian words, converted in one C-level pass."""
    a = array(TOKEN_TYPECODE)
    if type(tokens) is list:
        a.fromlist(tokens)  # faster than array(code, list), which uses the generic sequence API
    else:
        a.extend(tokens)
    if _LITTLE:
        a.byteswap()
    return a.tobytes()


def _enc_into(value: object, out: bytearray) -> None:
    # Order matters: bool before int (bool subclasses int), TokenArray before tuple.
    if value is None:
        out += b"\x00"
    elif isinstance(value, bool):
        raise TypeError("bool is not encodable (it would alias the ints 0 and 1)")
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"int {value} out of int64 range")
        out += b"\x01" + value.to_bytes(8, "big", signed=True)
    elif isinstance(value, bytes):
        out += b"\x02" + u64(len(value)) + value
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"\x03" + u64(len(raw)) + raw
    elif isinstance(value, TokenArray):
        out += b"\x05" + u64(len(value)) + tok_bytes(value)
    elif isinstance(value, tuple | list):
        out += b"\x04" + u64(len(value))
        for item in value:
            _enc_into(item, out)
    else:
        raise TypeError(f"cannot encode {type(value).__name__}")


def enc(value: object) -> bytes:
    """Canonical tagged, length-prefixed encoding (spec 5.3): unambiguous, so no two distinct
    values (``("ab", "c")`` vs ``("a", "bc")``, a salt vs a LoRA name) share bytes."""
    out = bytearray()
    _enc_into(value, out)
    return bytes(out)
