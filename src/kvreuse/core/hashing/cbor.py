"""vLLM's own block hashes: ``hash_algo = "sha256_cbor"`` (spec section 5, docs/events.md).

A router that recomputes vLLM's block hashes from a request's tokens (llm-d's KV indexer) finds
kvreuse's blocks only if kvreuse names them exactly as vLLM does. This mode reproduces vLLM
0.33.0's ``sha256_cbor`` chain, from its documented behaviour:

* the root (vLLM's ``NONE_HASH``) is ``sha256(cbor(seed))``, the seed a *string*: vLLM reads it
  from ``PYTHONHASHSEED``, and without it uses ``"vllm-none-hash"`` for its cryptographic hashes,
  so kvreuse's ``hash_seed`` unset means that same default;
* block ``k`` (tokens ``[(k-1)u, ku)``) is ``sha256(cbor((parent, tokens, extra_keys)))``, the
  parent's 32 digest bytes as a CBOR byte string, the tokens an array of ints, ``extra_keys``
  None or an array of ``("lora", name, path)``, ``("mm", identifier, offset - block start)`` for
  every multimodal item overlapping the block, then ``("cache_salt", salt)`` on block 1;
* the 64-bit int on the wire is the digest read big-endian, masked to 64 bits: its last eight
  bytes, which is `kvreuse.events.wire.hash64` of the core's digest unchanged.

CBOR here is canonical (RFC 8949 section 4.2.1) over the few types these messages hold (ints,
byte and text strings, arrays, null), which is what ``cbor2.dumps(..., canonical=True)`` writes
for them; the tests check both against vLLM itself. Encoding it here keeps the core free of a
dependency. There is no C kernel for it: `kvreuse.core.native.chain_kernel` returns None for
this algorithm, so the native and pure cores run this same Python. The chain itself is
`kvreuse.core.hashing.chain.CborChain`, which calls these functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

ALGO = "sha256_cbor"
DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed for cryptographic hashes without PYTHONHASHSEED
_sha256 = hashlib.sha256


def _head(major: int, n: int) -> bytes:
    """A CBOR item head in its shortest form (canonical): the argument inline below 24."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes((m | extra,)) + n.to_bytes(size, "big")
    raise ValueError(f"integer {n} does not fit CBOR's 64-bit argument")


def cbor(obj: Any) -> bytes:
    """Canonical CBOR of ints, str, bytes, None, bools and tuples/lists of them."""
    if obj is None:
        return b"\xf6"
    if obj is True or obj is False:
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _head(0, obj) if obj >= 0 else _head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return _head(3, len(raw)) + raw
    if isinstance(obj, tuple | list):
        return _head(4, len(obj)) + b"".join(map(cbor, obj))
    raise TypeError(f"no CBOR encoding here for {type(obj).__name__}: {obj!r}")


_SMALL: list[bytes] = []  # cbor(i) for token ids below 2**16, built on first use


def cbor_tokens(tokens: Sequence[int]) -> bytes:
    """``cbor(tuple(tokens))`` for non-negative token ids, through a table: this runs per block
    of every admitted request, and nearly every vocabulary id is below 2**16."""
    if not _SMALL:
        _SMALL.extend(_head(0, i) for i in range(1 << 16))
    small = _SMALL
    return _head(4, len(tokens)) + b"".join(
        [small[t] if t < 65536 else _head(0, t) for t in tokens]
    )


def check_seed(seed: object) -> str:
    """The seed as vLLM would read it from ``PYTHONHASHSEED``: a str; None means vLLM's default."""
    if seed is None:
        return DEFAULT_SEED
    if not isinstance(seed, str):
        raise TypeError(
            f"hash_algo {ALGO!r} needs hash_seed as a str (vLLM reads PYTHONHASHSEED as one), "
            f"got {type(seed).__name__}"
        )
    return seed


def none_hash(seed: str | bytes | None) -> bytes:
    """vLLM's ``NONE_HASH`` for ``PYTHONHASHSEED=seed`` (None: unset): the parent of block 1."""
    return _sha256(cbor(check_seed(seed))).digest()


def block_extra_keys(
    k: int, u: int, lora: tuple[str, str] | None, items: Sequence[Any], cache_salt: str | None
) -> tuple[Any, ...] | None:
    """vLLM's tagged extra keys of block ``k >= 1`` (None when it has none). ``items`` in
    order of offset, as vLLM keeps a request's multimodal features
    (`kvreuse.core.hashing.keys.MMItem`)."""
    s, e = (k - 1) * u, k * u
    keys: list[tuple[Any, ...]] = [("lora", lora[0], lora[1])] if lora is not None else []
    keys += [
        ("mm", it.identifier, it.offset - s)
        for it in items
        if it.length > 0 and it.offset < e and it.offset + it.length > s
    ]
    if k == 1 and cache_salt:  # "" is no salt, for vLLM too
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def block_hash(parent: bytes, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None) -> bytes:
    """One link straight from vLLM's definition: ``sha256(cbor((parent, tokens, extra)))``."""
    return _sha256(cbor((parent, tuple(tokens), extra_keys))).digest()
