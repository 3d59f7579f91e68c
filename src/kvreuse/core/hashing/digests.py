"""The digest ``D`` of spec 5.4 and the root ``H[0]``: which algorithms exist, the package each
needs (imported only when chosen, so the core stays importable without them), the default
seeds and the root of a configuration."""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable
from typing import Any

from kvreuse.core.encoding import enc
from kvreuse.core.hashing.cbor import none_hash

# the digests over kvreuse's own encoding `enc`; "sha256_cbor" is vLLM's own chain instead
# (`kvreuse.core.hashing.cbor`): its root depends on the seed alone and it has no lookahead
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


def digest_parts(algo: str) -> tuple[Callable[[bytes], Any] | None, Callable[[bytes], bytes]]:
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
    return digest_parts(algo)[1]


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
        return none_hash(seed)
    if seed is None:
        seed = default_seed(algo)
    return make_digest(algo)(enc(("kvr/root", algo, hash_unit, lookahead, seed)))
