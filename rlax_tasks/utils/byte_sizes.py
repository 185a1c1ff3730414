"""Sizes in bytes: the one grammar for reading them ("64GiB", "500MB", 1024) and one way to print.

Decimal units (kB…PB) are powers of 1000, binary ones (KiB…PiB) powers of 1024, in any case;
a plain integer is bytes. The run configuration, the parameter server's --keep-bytes and the
memory plan all read and print sizes here, so one spelling works everywhere."""

from __future__ import annotations

import argparse
import re
from typing import Any

KiB, MiB, GiB, TiB, PiB = (1 << (10 * i) for i in range(1, 6))
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_PREFIXES = "kmgtp"
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    **{f"{p}b": 1000**i for i, p in enumerate(_PREFIXES, start=1)},
    **{f"{p}ib": 1024**i for i, p in enumerate(_PREFIXES, start=1)},
}
_BINARY = ("KiB", "MiB", "GiB", "TiB", "PiB")


def parse_bytes(value: Any, minimum: int = 0) -> int:
    """Bytes from an integer or a size such as "64GiB", "1.5 TiB", "500MB", "1024".

    Raises ValueError naming ``value`` when it is not a size or is below ``minimum``.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = _NUMBER_UNIT.match(value) if isinstance(value, str) else None
        factor = _UNITS.get(m.group(2).lower()) if m else None
        if m is None or factor is None:
            raise ValueError(
                "must be a size in bytes such as 64GiB, 1.5TiB, 500MB or 1073741824 (units: B, "
                f"kB, MB, GB, TB, PB, KiB, MiB, GiB, TiB, PiB), got {value!r}"
            )
        number = m.group(1)
        size = int(float(number) * factor) if "." in number else int(number) * factor
    if size < minimum:
        raise ValueError(f"must be at least {minimum} byte(s), got {value!r}")
    return size


def parse_bytes_arg(text: str) -> int:
    """``parse_bytes`` for an argparse option: at least 1 byte; the error names the value."""
    try:
        return parse_bytes(text, minimum=1)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``, ``512`` -> ``'512 B'``: one decimal in the largest binary unit."""
    value, unit = float(n), "B"
    for larger in _BINARY:
        if abs(value) < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def exact_bytes(n: int) -> str:
    """``1536`` -> ``'1536 bytes (1.5 KiB)'``, ``512`` -> ``'512 bytes'``: exact, and readable."""
    return f"{n} bytes" if abs(n) < 1024 else f"{n} bytes ({format_bytes(n)})"


__all__ = [
    "GiB",
    "KiB",
    "MiB",
    "PiB",
    "TiB",
    "exact_bytes",
    "format_bytes",
    "parse_bytes",
    "parse_bytes_arg",
]
