"""Chained prefix hashing (spec section 5).

``H[k]`` names the whole prefix ``[0, k*u)`` of a request, its extra keys and, in lookahead mode,
the L tokens after it, because each unit's digest includes its parent.  The module is pure (no
I/O) and imports ``xxhash`` / ``blake3`` only when their algorithm is chosen, so the core stays
importable without them.

``enc`` (in `kvreuse.core.encoding`) is the normative definition of the hashed bytes.
``Chain.extend`` is the fast path: it emits exactly the bytes ``enc`` would, but splices them
from precomputed constant pieces and one bulk token conversion, because hashing runs on every
admitted token. With the optional C kernels (`kvreuse.core.native`), a run of SHA-256 units is
digested in one call over the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import struct
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.core import hashing_cbor as _cb
from kvreuse.core import native
from kvreuse.core.encoding import TokenArray, enc, tok_bytes, u64
from kvreuse.core.hashing_keys import Lora, MMItem, _check_extras, _prepare
from kvreuse.core.hashing_keys import unit_extra_keys as unit_extra_keys  # re-exported

# the digests over kvreuse's own encoding `enc`; "sha256_cbor" is vLLM's own chain instead
# (`kvreuse.core.hashing_cbor`): its root depends on the seed alone and it has no lookahead
ENCODED_ALGOS = ("sha256", "xxh3_128", "blake3")
HASH_ALGOS = (*ENCODED_ALGOS, "sha256_cbor")
_PACKAGES = {"xxh3_128": "xxhash", "blake3": "blake3"}


def _import(algo: str) -> Any:
    if algo not in _PACKAGES:
        raise ValueError(f"unknown hash_algo {algo!r}; expected one of {HASH_ALGOS}")
    pkg = _PACKAGES[algo]
    try:
        return __import__(pkg)
    except ImportError as e:
        raise ImportError(f"hash_algo {algo!r} needs the {pkg} package: pip install {pkg}") from e


def algo_available(algo: str) -> bool:
    """Whether ``algo`` is known and its package importable (config validation V7)."""
    try:
        if algo not in ("sha256", "sha256_cbor"):
            _import(algo)
    except (ImportError, ValueError):
        return False
    return True


def _digest_parts(algo: str) -> tuple[Callable[[bytes], Any] | None, Callable[[bytes], bytes]]:
    """``(ctor, digest)``. The hot loop inlines ``ctor(m).digest()`` when ``ctor`` is set, to
    avoid a Python wrapper frame per unit, else calls ``digest`` (a C function for xxh3)."""
    if algo in ("sha256", "sha256_cbor"):
        sha = hashlib.sha256
        return sha, lambda b: sha(b).digest()
    mod = _import(algo)
    if algo == "xxh3_128":
        return None, mod.xxh3_128_digest  # seed 0, canonical big-endian 16 bytes
    b3 = mod.blake3
    return b3, lambda b: b3(b).digest()


def make_digest(algo: str) -> Callable[[bytes], bytes]:
    """The digest ``D`` of spec 5.4 as a ``bytes -> bytes`` function."""
    return _digest_parts(algo)[1]


_random_seed: bytes | None = None


def default_seed(algo: str) -> str | bytes:
    """The seed used when ``hash_seed`` is unset (spec 5.4).

    SHA-256 gets a fixed string so routers and event consumers can recompute hashes anywhere.
    The fast digests get 32 random bytes drawn once per process, so sharing their keys across
    processes is an explicit opt-in (a common ``hash_seed``); the warning makes the otherwise
    silent loss of cross-process hits visible.
    """
    global _random_seed
    if algo == "sha256":
        return "kvreuse/v1"
    if algo == "sha256_cbor":
        return "vllm-none-hash"  # what vLLM uses for sha256_cbor without PYTHONHASHSEED
    if algo not in _PACKAGES:
        raise ValueError(f"unknown hash_algo {algo!r}; expected one of {HASH_ALGOS}")
    if _random_seed is None:
        _random_seed = os.urandom(32)
        warnings.warn(
            f"hash_algo {algo!r} without hash_seed: using a random per-process seed, so hashes "
            "are not shared across processes; set hash_seed to share them",
            stacklevel=2,
        )
    return _random_seed


def root_hash(algo: str, hash_unit: int, lookahead: int, seed: str | bytes | None) -> bytes:
    """``H[0] = D(enc(("kvr/root", algo, u, L, seed)))``: configurations with a different
    algorithm, unit, lookahead or seed never share a key."""
    if algo == "sha256_cbor":  # vLLM's NONE_HASH: its own derivation, not kvreuse's tuple
        return _cb.none_hash(seed)
    if seed is None:
        seed = default_seed(algo)
    return make_digest(algo)(enc(("kvr/root", algo, hash_unit, lookahead, seed)))


@dataclass(frozen=True, slots=True)
class UnitTemplate:
    """The constant pieces of ``enc(("kvr/unit", parent, Tok(unit), Tok(successors), X_k))``.

    Built once per configuration by `Hasher` and held by every chain, so `Chain.extend` splices
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
        hasher: Hasher,
        *,
        lora: Lora | None = None,
        mm_items: Sequence[MMItem] = (),
        cache_salt: str | None = None,
    ) -> None:
        self.template = t = hasher.template
        self.hashes: list[bytes] = [t.root]
        # n, the number of hashed units (len(hashes) - 1): the chain proves nothing beyond n*u
        # tokens. A plain attribute, kept by `extend`: it is read several times per step.
        self.num_units = 0
        if lora is None and not mm_items and cache_salt is None:  # most requests: no keys
            self._base, self._salt, self._mm, self._special_max = (), (), [], 0
            self._xdef = _NO_KEYS
            return
        self._base, items, self._salt = _prepare(lora, mm_items, cache_salt)
        self._xdef = enc(self._base)  # X_k of every unit without mm keys or salt
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
    for hash_algo "sha256_cbor" (the encoding and vLLM's rules: `kvreuse.core.hashing_cbor`)."""

    __slots__ = ("_items", "_lora", "_nokeys", "_xlast", "cache_salt")

    def __init__(
        self,
        hasher: Hasher,
        *,
        lora: Lora | None = None,
        mm_items: Sequence[MMItem] = (),
        cache_salt: str | None = None,
    ) -> None:
        _check_extras(lora, mm_items, cache_salt)
        self.template = t = hasher.template
        self.hashes = [t.root]
        self.num_units = 0
        self._lora = lora
        self.cache_salt = cache_salt or None  # read by the core's BlockStored events
        self._items = sorted((it for it in mm_items if it.length > 0), key=lambda it: it.offset)
        self._nokeys = _cb.cbor(_cb.block_extra_keys(2, t.hash_unit, lora, (), None))
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
                _cb.cbor(_cb.block_extra_keys(k, u, self._lora, self._items, self.cache_salt))
                if k <= xlast
                else nokeys
            )
            # (parent, tokens, extra) as a 3-array; the parent is always a 32-byte string
            msg = b"\x83\x58\x20" + last + _cb.cbor_tokens(tokens[(k - 1) * u : k * u]) + extra
            last = hashlib.sha256(msg).digest()
            ap(last)
        self.num_units = n
        return n


class Hasher:
    """Per-configuration hashing (algorithm, unit u, lookahead L, seed); builds chains.

    Holds the root and the `UnitTemplate` (the constant byte pieces of
    ``enc(("kvr/unit", parent, Tok, Tok, X))``), computed once per configuration instead of
    once per unit.
    """

    def __init__(
        self,
        algo: str = "sha256",
        hash_unit: int = 16,
        lookahead: int = 0,
        seed: str | bytes | None = None,
    ) -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"unknown hash_algo {algo!r}; expected one of {HASH_ALGOS}")
        if type(hash_unit) is not int or hash_unit < 1:
            raise ValueError(f"hash_unit must be an int >= 1, got {hash_unit!r}")
        if type(lookahead) is not int or lookahead < 0:
            raise ValueError(f"lookahead must be an int >= 0, got {lookahead!r}")
        if seed is not None and not isinstance(seed, str | bytes):
            raise TypeError("hash_seed must be str, bytes or None")
        if algo == "sha256_cbor" and lookahead:
            raise ValueError("hash_algo 'sha256_cbor' has no lookahead: vLLM hashes a block alone")
        self.algo, self.hash_unit, self.lookahead = algo, hash_unit, lookahead
        self.root = root = root_hash(algo, hash_unit, lookahead, seed)
        ctor, self.digest = _digest_parts(algo)
        self.template = UnitTemplate(
            hash_unit=hash_unit,
            lookahead=lookahead,
            root=root,
            pre=b"\x04" + u64(5) + enc("kvr/unit") + b"\x02" + u64(len(root)),
            mid=b"\x05" + u64(hash_unit),
            la_hdr=b"\x05" + u64(lookahead),
            unit_struct=struct.Struct(f"{4 * hash_unit}s"),
            ctor=ctor,
            digest=self.digest,
            kernel=native.chain_kernel(algo),
        )

    def chain(
        self,
        *,
        lora: Lora | None = None,
        mm_items: Sequence[MMItem] = (),
        cache_salt: str | None = None,
    ) -> Chain:
        """A new chain, holding only the root, for one request's extra keys."""
        if self.algo == "sha256_cbor":
            return CborChain(self, lora=lora, mm_items=mm_items, cache_salt=cache_salt)
        return Chain(self, lora=lora, mm_items=mm_items, cache_salt=cache_salt)

    def hash_units(self, tokens: Sequence[int], **extra: Any) -> list[bytes]:
        """``[H[0], ..., H[n]]`` of a whole token list (``extra``: the ``chain`` keywords)."""
        c = self.chain(**extra)
        c.extend(tokens)
        return c.hashes

    def unit_hash(
        self, parent: bytes, tokens: Sequence[int], successors: Sequence[int], extra_keys: tuple
    ) -> bytes:
        """One link, straight from the definition: lets an event consumer recompute ``H[k]``
        from ``parent_hash`` (spec 13), and is the reference the fast path is tested against.
        For ``sha256_cbor`` it is vLLM's link, ``extra_keys`` vLLM's tagged keys (or None)."""
        if self.algo == "sha256_cbor":
            return _cb.block_hash(parent, tokens, extra_keys or None)
        msg = ("kvr/unit", parent, TokenArray(tokens), TokenArray(successors), extra_keys)
        return self.digest(enc(msg))
