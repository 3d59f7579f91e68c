"""The hasher of one configuration (algorithm, unit u, lookahead L, seed): the root, the
`UnitTemplate` its chains share, and a new chain per request."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from kvreuse.core import native
from kvreuse.core.encoding import TokenArray, enc, u64
from kvreuse.core.hashing.cbor import block_hash
from kvreuse.core.hashing.chain import CborChain, Chain, UnitTemplate
from kvreuse.core.hashing.digests import HASH_ALGOS, digest_parts, root_hash
from kvreuse.core.hashing.keys import Lora, MMItem


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
        ctor, self.digest = digest_parts(algo)
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
            return CborChain(self.template, lora=lora, mm_items=mm_items, cache_salt=cache_salt)
        return Chain(self.template, lora=lora, mm_items=mm_items, cache_salt=cache_salt)

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
            return block_hash(parent, tokens, extra_keys or None)
        msg = ("kvr/unit", parent, TokenArray(tokens), TokenArray(successors), extra_keys)
        return self.digest(enc(msg))
