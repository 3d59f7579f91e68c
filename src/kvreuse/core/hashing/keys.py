"""The extra keys of a chain (spec 5.2): LoRA, multimodal items and the cache salt, validated
and put in canonical order. Read by kvreuse's own chain and vLLM's
(`kvreuse.core.hashing.chain`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvreuse.core.encoding import INT64_MAX, enc

Lora = tuple[str, str]


class MMItem(Protocol):
    """A multimodal placeholder range; ``identifier`` names its *content*, not its location.
    Read-only members: a frozen dataclass (``MultiModalItem``) is one."""

    @property
    def identifier(self) -> str | bytes: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


def check_extras(lora: Lora | None, mm_items: Sequence[MMItem], cache_salt: str | None) -> None:
    # str and bytes encode differently, so a wrong type would silently split the key space.
    if lora is not None and not (
        isinstance(lora, tuple) and len(lora) == 2 and all(isinstance(x, str) for x in lora)
    ):
        raise TypeError(f"lora must be a (name, path) tuple of str, got {lora!r}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise TypeError(f"cache_salt must be str, got {cache_salt!r}")
    for it in mm_items:
        if not isinstance(it.identifier, str | bytes):
            raise TypeError(f"multimodal identifier must be str or bytes: {it.identifier!r}")
        if type(it.offset) is not int or type(it.length) is not int:
            raise TypeError(f"multimodal offset and length must be int: {it!r}")
        if not (0 <= it.offset <= INT64_MAX and 0 <= it.length <= INT64_MAX):  # enc: int64
            raise ValueError(f"multimodal offset and length must be ints in [0, 2**63): {it!r}")


def prepare_extras(
    lora: Lora | None, mm_items: Sequence[MMItem], cache_salt: str | None
) -> tuple[tuple, list[MMItem], tuple]:
    """Validated ``(lora keys, items in canonical order, salt keys)``."""
    check_extras(lora, mm_items, cache_salt)
    base = (("lora", lora[0], lora[1]),) if lora is not None else ()
    items = sorted(mm_items, key=lambda it: (it.offset, enc(it.identifier)))
    return base, items, ((("salt", cache_salt),) if cache_salt else ())  # "" means no salt


def unit_extra_keys(
    k: int,
    u: int,
    lookahead: int,
    lora: Lora | None,
    mm_items: Sequence[MMItem],
    cache_salt: str | None,
) -> tuple:
    """``X_k`` of spec 5.2 for unit ``k >= 1``: the LoRA key, the multimodal items whose
    placeholder range meets the window ``[(k-1)u, k*u + L)``, then the salt (unit 1 only)."""
    base, items, salt = prepare_extras(lora, mm_items, cache_salt)
    s, e = (k - 1) * u, k * u + lookahead
    mm = tuple(
        ("mm", it.identifier, it.offset - s)
        for it in items
        if it.length > 0 and it.offset < e and it.offset + it.length > s
    )
    return base + mm + (salt if k == 1 else ())
