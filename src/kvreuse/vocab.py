"""The command line's shared vocabulary: argparse types for counts, numbers and sizes, the help
formatter every command uses, how reports write a size, a share and a count, and the options
several commands share (`--num-blocks`; the tier options of `kvreuse simulate`, `sweep` and
`serve`). It imports nothing of kvreuse, so that every command's parser (and the server's) can
use it without the simulator.

A size is a count of tokens or blocks, written as traces and papers write them: `4096`,
`1_000_000`, `3M`, `1.5G` (K, M, G, T: decimal 10^3 … 10^12) and, where an option allows it,
`inf` (or `unlimited`). Every option that takes tokens or blocks reads it with `size`,
`size_list` (`parse_sizes`) or `num_blocks`, so `--capacity-tokens 3M` works wherever
`--capacity 3M` does. A size is written back two ways, told apart by their names: `exact_size`
(a bound, a capacity the user chose: the value itself) and `size_at_least` (a capacity to
suggest: rounded up, so that it still suffices).
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
_WRITTEN = (("T", 10**12), ("G", 10**9), ("M", 10**6), ("K", 10**3))  # largest first
MAX_SIZE = 2**63 - 1  # the largest size any option reads (a TOML integer's limit)

# The largest pool a deployment may ask for. The pool keeps about 70 bytes of bookkeeping per
# block from the start and about 177 once a block holds a cached entry (benchmarks/core_bench.py),
# so 2**24 blocks stay near 3 GB; a typo such as num_blocks = 10**9 would need 177 GB.
MAX_NUM_BLOCKS = 2**24
BYTES_PER_CACHED_BLOCK = 177


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
            f"must be a whole number in {exact_size(low)} … {exact_size(high)} (an integer, or a "
            f"number with K, M, G or T: 10^3 … 10^12{', or inf' if unlimited else ''}), "
            f"got {text.strip()!r}"
        )
    return value


def parse_sizes(text: str, low: int, high: int, unlimited: bool = False) -> list[int | None]:
    """'1M,3M,inf' → [1_000_000, 3_000_000, None]: comma-separated sizes as `parse_size` reads
    each (an empty one included: it is refused), none given twice; a ValueError saying which
    otherwise."""
    out: list[int | None] = []
    for part in text.split(","):
        value = parse_size(part, low, high, unlimited)
        if value in out:
            raise ValueError(f"{part.strip()!r} is given twice")
        out.append(value)
    return out


def exact_size(n: int | None) -> str:
    """`n` exactly, as the options read it: in the largest unit that writes it with at most
    three digits before the point and three after (1,500,000 → '1.5M', 8,192 → '8.192K'; T
    takes any number of thousands: 10^15 → '1,000T'), else with thousands separators
    (16,777,216); None (no limit) → 'inf'. For bounds and for sizes the user chose."""
    if n is None:
        return "inf"
    for unit, scale in _WRITTEN:
        whole, frac = divmod(n, scale)
        if whole and (whole < 1000 or unit == "T") and (frac * 1000) % scale == 0:
            decimals = f"{frac * 1000 // scale:03d}".rstrip("0")
            return f"{whole:,}{'.' if decimals else ''}{decimals}{unit}"
    return f"{n:,}"


def size_at_least(n: int) -> str:
    """`n` rounded up to three significant digits, in the sizes the options read: 163,839 →
    '164K', 3,000,000 → '3M', 900 → '900'. For a size to suggest: it is never below `n`."""
    for unit, scale in (("G", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            digits = max(0, 3 - len(str(n // scale)))
            step = 10**digits
            value = math.ceil(n * step / scale) / step
            return f"{value:g}{unit}"
    return str(n)


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
    """An argparse type: comma-separated sizes, each in [low, high], none given twice
    (`parse_sizes`)."""

    def parse(text: str) -> list[int]:
        try:
            return [v for v in parse_sizes(text, low, high) if v is not None]  # no inf here
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"comma-separated sizes: {exc}") from None

    return parse


def too_many_blocks(blocks: int, what: str, whose: str = "the pool's") -> str | None:
    """None when `blocks` blocks of pool bookkeeping fit under MAX_NUM_BLOCKS; else one line:
    `what` (the blocks as the caller names them) is too large, about how many GB `whose`
    bookkeeping would need, and the limit. The one ceiling of a pool, and of the pools one
    process holds at once."""
    if blocks <= MAX_NUM_BLOCKS:
        return None
    gb = blocks * BYTES_PER_CACHED_BLOCK / 1e9
    return (
        f"{what} is too large: {whose} bookkeeping alone would need about {gb:,.1f} GB "
        f"({BYTES_PER_CACHED_BLOCK} bytes per cached block); the limit is {MAX_NUM_BLOCKS:,} blocks"
    )


def num_blocks(text: str) -> int:
    """An argparse type: a pool in blocks, the null block included: a size in 2 …
    MAX_NUM_BLOCKS (a larger one is told what its bookkeeping would need)."""
    try:
        value = parse_size(text, 2, MAX_SIZE)
    except ValueError:
        value = None  # not a size, or below 2: the bounds below say what is allowed
    if value is not None and value > MAX_NUM_BLOCKS:
        raise argparse.ArgumentTypeError(too_many_blocks(value, f"{value:,} blocks"))
    return size(2, MAX_NUM_BLOCKS)(text)


def add_num_blocks(p: Any, help: str) -> None:
    """`--num-blocks N`, the pool in blocks (`num_blocks`); absent: None, the geometry's."""
    p.add_argument("--num-blocks", type=num_blocks, default=None, metavar="N", help=help)


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
            type=size(1, MAX_SIZE),
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
