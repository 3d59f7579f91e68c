"""A request's hash chain (spec 5): ``hashes[k] == H[k]``, extended as tokens arrive.

``H[k]`` names the whole prefix ``[0, k*u)`` of a request, its extra keys and, in lookahead
mode, the L tokens after it, because each unit's digest includes its parent. ``enc`` (in
`kvreuse.core.encoding`) is the normative definition of the hashed bytes; ``Chain.extend`` is
the fast path: it emits exactly the bytes ``enc`` would, but splices them from the constant
pieces of a `UnitTemplate` and one bulk token conversion, because hashing runs on every
admitted token. With the optional C kernels (`kvreuse.core.native`), a run of SHA-256 units is
digested in one call over the same bytes. `CborChain` is vLLM's chain instead
(`kvreuse.core.hashing.cbor`), for hash_algo "sha256_cbor".
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.core.encoding import enc, tok_bytes
from kvreuse.core.hashing.cbor import block_extra_keys, cbor, cbor_tokens
from kvreuse.core.hashing.keys import Lora, MMItem, check_extras, prepare_extras


@dataclass(frozen=True, slots=True)
class UnitTemplate:
    """The constant pieces of ``enc(("kvr/unit", parent, Tok(unit), Tok(successors), X_k))``.

    Built once per configuration by the `Hasher` and held by every chain, so `Chain.extend` splices
    each unit's message from them instead of encoding the 5-tuple per unit:

        pre | parent | mid | unit tokens | la_hdr | successor tokens | enc(X_k)
    """

    hash_unit: int
    lookahead: int
    root: bytes  # H[0], the parent of unit 1
    pre: bytes  # tuple header, enc("kvr/unit"), the parent's bytes header
    mid: bytes  # the unit's token-array header
    la_hdr: bytes  # the successors' token-array header
    unit_struct: struct.Struct  # one unit's token bytes, for C-level per-unit slicing
    ctor: Callable[[bytes], Any] | None  # inlined as ctor(m).digest() when set
    digest: Callable[[bytes], bytes]
    # native.chain_kernel: digests a run of units in one C call (None: the Python loops)
    kernel: Callable[..., list[bytes]] | None = None


_NO_KEYS = enc(())  # X_k of a unit of a request without extra keys


class Chain:
    """Incremental hash chain of ONE request: ``hashes[k] == H[k]``, ``hashes[0]`` the root.

    Units are hashed once, in order, as tokens arrive; a prefix is never rehashed.
    """

    __slots__ = (
        "_base",
        "_mm",
        "_salt",
        "_special_max",
        "_xdef",
        "hashes",
        "num_units",
        "template",
    )

    def __init__(
        self,
        template: UnitTemplate,
        *,
        lora: Lora | None = None,
        mm_items: Sequence[MMItem] = (),
        cache_salt: str | None = None,
    ) -> None:
        self.template = template
        self.hashes: list[bytes] = [template.root]
        # n, the number of hashed units (len(hashes) - 1): the chain proves nothing beyond n*u
        # tokens. A plain attribute, kept by `extend`: it is read several times per step.
        self.num_units = 0
        self._keep_keys(lora, mm_items, cache_salt)

    def _keep_keys(
        self, lora: Lora | None, mm_items: Sequence[MMItem], cache_salt: str | None
    ) -> None:
        """Validate the extra keys and keep what `extend` needs of them (each chain its own)."""
        if lora is None and not mm_items and cache_salt is None:  # most requests: no keys
            self._base, self._salt, self._mm, self._special_max = (), (), [], 0
            self._xdef = _NO_KEYS
            return
        self._base, items, self._salt = prepare_extras(lora, mm_items, cache_salt)
        self._xdef = enc(self._base)  # X_k of every unit without mm keys or salt
        t = self.template
        u, la = t.hash_unit, t.lookahead
        # (first unit, last unit, identifier, offset) of each item whose window meets a unit, in
        # canonical order. Only the bounds are computed here: an item may reach far beyond the
        # tokens (a placeholder of 2**40), and its keys are built per unit as units are hashed.
        self._mm = [
            (
                max(1, (it.offset - la) // u + 1),
                -(-(it.offset + it.length) // u),
                it.identifier,
                it.offset,
            )
            for it in items
            if it.length > 0
        ]
        # the last unit whose X_k differs from _xdef
        self._special_max = max((hi for _, hi, _, _ in self._mm), default=1 if self._salt else 0)

    def adopt(self, hashes: Sequence[bytes]) -> None:
        """Take ``hashes`` as H[1] … H[k] of a chain that holds only its root: digests a caller
        computed before with this configuration and the same extra keys, for the same leading
        tokens (a shared prefix hashed once). They are trusted, not recomputed; `extend` then
        hashes the units after them."""
        if len(self.hashes) != 1:
            raise ValueError("adopt: the chain has hashed units already; adopt on a new chain")
        self.hashes = [self.template.root]
        self.hashes += hashes
        self.num_units = len(hashes)

    def _xenc(self, k: int) -> bytes:
        if k > self._special_max:
            return self._xdef
        s = (k - 1) * self.template.hash_unit
        mm = tuple(("mm", ident, off - s) for lo, hi, ident, off in self._mm if lo <= k <= hi)
        return enc(self._base + mm + (self._salt if k == 1 else ()))

    def extend(self, tokens: Sequence[int]) -> int:
        """Hash every new unit k with ``k*u + L <= len(tokens)``; return the unit count n.

        ``tokens`` is the request's full sequence so far, already validated by the caller.
        """
        t = self.template
        u, la, kernel = t.hash_unit, t.lookahead, t.kernel
        n0 = len(self.hashes) - 1
        n = (len(tokens) - la) // u
        if n <= n0:
            return n0
        # Units whose X_k varies (salt, mm) take the general loop; so does every unit in
        # lookahead mode on the pure path. The rest is one kernel call or the fast loop.
        k_end = n if la and kernel is None else max(n0, min(n, self._special_max))
        if k_end > n0:
            self._extend_general(tokens, n0, k_end)
        if n > k_end:
            if kernel is not None:
                last, xdef = self.hashes[-1], self._xdef
                self.hashes += kernel(
                    last, t.pre, t.mid, t.la_hdr, xdef, tokens, k_end * u, n - k_end, u, la
                )
            else:
                self._extend_fast(tokens, k_end, n)
        self.num_units = n
        return n

    def _extend_general(self, tokens: Sequence[int], n0: int, k_end: int) -> None:
        """Units n0+1 … k_end, each message spliced with its own X_k and successors."""
        t = self.template
        u, la = t.hash_unit, t.lookahead
        step, lstep = 4 * u, 4 * la
        tb = _words(tokens, n0 * u, k_end * u + la)
        ap, last, join = self.hashes.append, self.hashes[-1], b"".join
        digest, xenc, xdef, smax = t.digest, self._xenc, self._xdef, self._special_max
        parts: list[bytes | memoryview] = [t.pre, last, t.mid, b"", t.la_hdr, b"", b""]
        for k, i in enumerate(range(0, (k_end - n0) * step, step), n0 + 1):
            j = i + step
            parts[1], parts[3], parts[5] = last, tb[i:j], tb[j : j + lstep]
            parts[6] = xdef if k > smax else xenc(k)
            last = digest(join(parts))
            ap(last)

    def _extend_fast(self, tokens: Sequence[int], k0: int, n: int) -> None:
        """Units k0+1 … n when L = 0 and X_k is constant: only the parent and the unit's
        tokens change between messages."""
        t = self.template
        u = t.hash_unit
        tb = _words(tokens, k0 * u, n * u)
        ap, last, join = self.hashes.append, self.hashes[-1], b"".join
        parts = [t.pre, last, t.mid, b"", t.la_hdr + self._xdef]
        units = t.unit_struct.iter_unpack(tb)
        ctor = t.ctor
        if ctor is not None:
            for (parts[3],) in units:
                parts[1] = last
                last = ctor(join(parts)).digest()
                ap(last)
        else:
            digest = t.digest
            for (parts[3],) in units:
                parts[1] = last
                last = digest(join(parts))
                ap(last)


def _words(tokens: Sequence[int], lo: int, hi: int) -> memoryview:
    """Tokens [lo, hi) as 4-byte big-endian words.

    Slicing a long list costs more than converting it (refcount traffic on every int), so a
    run that covers most of the sequence converts all of it and the view drops the surplus.
    """
    if 2 * (hi - lo) >= len(tokens):
        return memoryview(tok_bytes(tokens))[4 * lo : 4 * hi]
    return memoryview(tok_bytes(tokens[lo:hi]))


class CborChain(Chain):
    """A `Chain` whose ``hashes[k]`` are vLLM's block hashes (``hashes[0]``: ``NONE_HASH``),
    for hash_algo "sha256_cbor" (the encoding and vLLM's rules: `kvreuse.core.hashing.cbor`)."""

    __slots__ = ("_items", "_lora", "_nokeys", "_xlast", "cache_salt")

    def _keep_keys(
        self, lora: Lora | None, mm_items: Sequence[MMItem], cache_salt: str | None
    ) -> None:
        check_extras(lora, mm_items, cache_salt)
        t = self.template
        self._lora = lora
        self.cache_salt = cache_salt or None  # read by the core's BlockStored events
        self._items = sorted((it for it in mm_items if it.length > 0), key=lambda it: it.offset)
        self._nokeys = cbor(block_extra_keys(2, t.hash_unit, lora, (), None))
        # past the last multimodal item and block 1, every block's extra keys are _nokeys
        u = t.hash_unit
        self._xlast = max((-(-(it.offset + it.length) // u) for it in self._items), default=1)

    def extend(self, tokens: Sequence[int]) -> int:
        """Hash every new full block; return the block count n (same contract as `Chain`)."""
        u = self.template.hash_unit
        n0, n = len(self.hashes) - 1, len(tokens) // u
        if n <= n0:
            return n0
        last, ap, nokeys, xlast = self.hashes[-1], self.hashes.append, self._nokeys, self._xlast
        for k in range(n0 + 1, n + 1):
            extra = (
                cbor(block_extra_keys(k, u, self._lora, self._items, self.cache_salt))
                if k <= xlast
                else nokeys
            )
            # (parent, tokens, extra) as a 3-array; the parent is always a 32-byte string
            msg = b"\x83\x58\x20" + last + cbor_tokens(tokens[(k - 1) * u : k * u]) + extra
            last = hashlib.sha256(msg).digest()
            ap(last)
        self.num_units = n
        return n
