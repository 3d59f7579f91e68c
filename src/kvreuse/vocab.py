"""The command line's shared vocabulary: argparse types for counts, numbers and sizes, the help
formatter every command uses, how reports write a share and a count, and the tier options that
`kvreuse simulate`, `sweep` and `serve` share. It imports nothing of kvreuse, so that every
command's parser (and the server's) can use it without the simulator.

A size is a count of tokens or blocks, written as traces and papers write them: `4096`,
`1_000_000`, `3M`, `1.5G` (K, M, G, T: decimal 10^3 … 10^12) and, where an option allows it,
`inf` (or `unlimited`). Every option that takes tokens or blocks reads it with `size` or
`size_list`, so `--capacity-tokens 3M` works wherever `--capacity 3M` does.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Any

UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
UNLIMITED = ("inf", "unlimited")
_SIZE = re.compile(r"(\d[\d_]*(?:\.\d*)?|\.\d+)\s*([kmgt]?)")


def parse_size(text: str, low: int, high: int, unlimited: bool = False) -> int | None:
    """'3M' → 3_000_000, '1.5k' → 1500, 'inf' → None (only with `unlimited`). A size that is
    not a whole number of tokens or blocks, or outside [low, high], is a ValueError saying
    what is allowed."""
    word = text.strip().lower()
    if unlimited and word in UNLIMITED:
        return None
    value = -1
    m = _SIZE.fullmatch(word)
    if m:
        try:
            exact = Decimal(m[1].replace("_", "")) * UNITS[m[2]]
        except InvalidOperation:
            exact = Decimal(-1)
        if exact == exact.to_integral_value():
            value = int(exact)
    if not low <= value <= high:
        raise ValueError(
            f"must be a whole number in {_short(low)} … {_short(high)} (an integer, or a "
            f"number with K, M, G or T: 10^3 … 10^12{', or inf' if unlimited else ''}), "
            f"got {text.strip()!r}"
        )
    return value


def _short(n: int) -> str:
    """A bound as the help shows it: 3M for 3,000,000, else with thousands separators."""
    for unit, scale in (("T", 10**12), ("G", 10**9), ("M", 10**6)):
        if n >= scale and n % scale == 0:
            return f"{n // scale:,}{unit}"
    return f"{n:,}"


def size(low: int, high: int, unlimited: bool = False) -> Callable[[str], int]:
    """An argparse type: a size in [low, high] (`unlimited`: or inf, read as math.inf, which
    the option's user compares with `== math.inf`)."""

    def parse(text: str) -> int:
        try:
            value = parse_size(text, low, high, unlimited)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return math.inf if value is None else value  # type: ignore[return-value]

    return parse


def size_list(low: int, high: int) -> Callable[[str], list[int]]:
    """An argparse type: comma-separated sizes, each in [low, high], none given twice."""

    def parse(text: str) -> list[int]:
        out: list[int] = []
        for part in (p for p in text.split(",") if p.strip()):
            try:
                value = int(parse_size(part, low, high) or 0)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"comma-separated sizes: {exc}") from None
            if value in out:
                raise argparse.ArgumentTypeError(f"{part.strip()!r} is given twice")
            out.append(value)
        if not out:
            raise argparse.ArgumentTypeError(f"must be comma-separated sizes, got {text!r}")
        return out

    return parse


def int_range(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (argparse names the option in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            value = low - 1
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be an integer in {low:,} … {high:,}, got {text!r}"
            )
        return value

    return parse


def number(low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite float in [low, high] ((low, high] with `low_open`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        above = value > low if low_open else value >= low
        if not (math.isfinite(value) and above and value <= high):
            opening = "(" if low_open else "["
            raise argparse.ArgumentTypeError(
                f"must be a finite number in {opening}{low:g}, {high:g}], got {text!r}"
            )
        return value

    return parse


class Help(argparse.HelpFormatter):
    """Every command's help: an option's default is shown once, as `(default: X)`, and only
    when it says something (not for a flag, nor for an option whose absence its help already
    describes with its own "default")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        quiet = default is None or default is False or default is argparse.SUPPRESS
        quiet = quiet or "default" in text
        if quiet or not action.option_strings or action.nargs == 0:
            return text
        if isinstance(default, list):
            default = ",".join(str(d) for d in default)
        return f"{text} (default: {default})" if text else f"default: {default}"


def percent(part: float, whole: float) -> str:
    """`part` / `whole` as a percentage with one decimal, and more where one would round a
    share that is not all (or not none) to 100.0 % (or 0.0 %): 32,752 of 32,768 is 99.95 %."""
    if whole <= 0:
        return "—"
    share = part / whole
    for digits in range(1, 6):
        text = f"{share:.{digits}%}"
        if 0 < share < 1 and text in (f"{1:.{digits}%}", f"{0:.{digits}%}"):
            continue
        return text
    return text


def plural(count: int, noun: str, many: str | None = None) -> str:
    """'1 request', '2 requests', '1,024 blocks'."""
    return f"{count:,} {noun if count == 1 else many or noun + 's'}"


STORE_ADMISSIONS = ("on-eviction", "write-through")  # Admission values, as options spell them


def add_tier_options(p: Any, where: str) -> None:
    """`--host-capacity N` and `--store-capacity N`: memory tiers below `where` (docs/tiers.md),
    each with room for the blocks one request of N tokens needs."""
    for tier, what in (("host", "a host-memory tier"), ("store", "a shared-store tier")):
        p.add_argument(
            f"--{tier}-capacity",
            type=size(1, 2**63 - 1),
            default=None,
            metavar="N",
            help=f"{what} below {where}, with room for the blocks one request of N tokens "
            "needs (30M); evicted blocks go there and hits load them back",
        )
    p.add_argument(
        "--store-admission",
        choices=STORE_ADMISSIONS,
        default="on-eviction",
        help="what enters the store: blocks evicted from above (on-eviction), or every block "
        "as soon as it is computed (write-through: replicas sharing the store then find a "
        "prefix another replica still holds)",
    )
