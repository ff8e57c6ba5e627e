"""Human-readable byte sizes ("512MB", "1GiB", "2KB")."""

from __future__ import annotations

import re

from ..errors import InvalidArgumentError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Parse a byte count: an int, or a string such as ``"512MB"``, ``"1GiB"`` or ``"2KB"``.

    Decimal units (KB, MB, GB) are powers of 1000, binary units (KiB, MiB, GiB) powers of 1024.

    >>> parse_size("512MB"), parse_size("1GiB"), parse_size(2048)
    (512000000, 1073741824, 2048)
    """
    if isinstance(value, bool):
        raise InvalidArgumentError(f"size must be a number of bytes or a string like '512MB', got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        match = _SIZE_RE.match(str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidArgumentError(
                f"cannot read {value!r} as a size: use a number of bytes or a number with a unit "
                "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '512MB'"
            )
        n = int(float(match.group(1)) * _UNITS[unit])
    if n <= 0:
        raise InvalidArgumentError(f"size must be positive, got {value!r}")
    return n


def format_size(n: int) -> str:
    """Format a byte count for people: ``format_size(1536) == '1.5 KiB'``."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


_COUNT_UNITS = {"": 1, "k": 1000, "m": 1000**2, "b": 1000**3, "g": 1000**3, "t": 1000**4}


def parse_count(value: int | str) -> int:
    """Parse a count of things such as tokens: an int, or ``"50M"``, ``"2.5B"``, ``"100k"``, ``"1e8"``.

    >>> parse_count("50M"), parse_count("2.5B"), parse_count("1e8"), parse_count(7)
    (50000000, 2500000000, 100000000, 7)
    """
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        match = re.match(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([a-zA-Z]?)\s*$", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _COUNT_UNITS or isinstance(value, bool):
            raise InvalidArgumentError(f"cannot read {value!r} as a count: use a whole number, optionally with "
                                       "k, M or B (thousands, millions, billions), e.g. 50M")
        x = float(match.group(1)) * _COUNT_UNITS[unit]
        if not x.is_integer():
            raise InvalidArgumentError(f"{value!r} is not a whole number")
        n = int(x)
    if n <= 0:
        raise InvalidArgumentError(f"a count must be positive, got {value!r}")
    return n


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """``n`` and its noun, singular for one: ``1 layer``, ``3 layers``, ``1,024 windows``.

    >>> plural(1, "layer"), plural(3, "layer"), plural(2, "child", "children")
    ('1 layer', '3 layers', '2 children')
    """
    return f"{n:,} {noun if n == 1 else (nouns or noun + 's')}"
