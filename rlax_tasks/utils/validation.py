"""Field checks shared by every configuration class (JAX-free): one wording, the caller's error.

Each check takes ``error``, a callable (field, detail) -> exception, and raises what it returns;
an error class built from (field, message) passes itself, a one-argument one passes
``field_error(TheError)`` ("<field> <detail>", e.g. ``warmup_steps must be >= 0, got -1``)."""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

ErrorFactory = Callable[[str, str], Exception]


def field_error(cls: Callable[[str], Exception], sep: str = " ") -> ErrorFactory:
    """An ``error`` for a one-argument error class: the message is field + ``sep`` + detail."""

    def make(field: str, detail: str) -> Exception:
        return cls(f"{field}{sep}{detail}")

    return make


def did_you_mean(word: Any, options: Iterable[Any]) -> str:
    """' (did you mean 'x'?)' for the closest of ``options`` to ``word``, or ''."""
    close = difflib.get_close_matches(str(word), [str(o) for o in options], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _is_int(value: Any) -> bool:
    """An integer (Python's or NumPy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(
    field: str,
    value: Any,
    error: ErrorFactory,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    optional: bool = False,
) -> int | None:
    """``value`` when it is an integer in [minimum, maximum] (or None when ``optional``)."""
    if value is None and optional:
        return None
    if not _is_int(value):
        raise error(field, f"must be an integer{' or null' if optional else ''}, got {value!r}")
    low_ok = minimum is None or value >= minimum
    high_ok = maximum is None or value <= maximum
    if minimum is not None and maximum is not None and not (low_ok and high_ok):
        raise error(field, f"must lie in [{minimum}, {maximum}], got {value}")
    if not low_ok:
        raise error(field, f"must be >= {minimum}, got {value}")
    if not high_ok:
        raise error(field, f"must be <= {maximum}, got {value}")
    return value


def check_number(
    field: str,
    value: Any,
    error: ErrorFactory,
    *,
    low: float = -math.inf,
    high: float = math.inf,
    open_low: bool = False,
    open_high: bool = False,
    from_text: bool = False,
) -> float:
    """``float(value)`` when it is a finite number in the interval given by low/high.

    ``from_text``: also accept a numeric string (YAML 1.1 reads ``1e-4``, without a dot, as text).
    """
    if from_text and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise error(field, f"must be a finite number, got {value!r}") from None
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise error(field, f"must be a finite number, got {value!r}")
    below = value <= low if open_low else value < low
    above = value >= high if open_high else value > high
    if below or above:
        if math.isinf(high):
            raise error(field, f"must be {'>' if open_low else '>='} {low}, got {value}")
        if math.isinf(low):
            raise error(field, f"must be {'<' if open_high else '<='} {high}, got {value}")
        lo, hi = "(" if open_low else "[", ")" if open_high else "]"
        raise error(field, f"must lie in {lo}{low}, {high}{hi}, got {value}")
    return float(value)


def check_bool(field: str, value: Any, error: ErrorFactory) -> bool:
    """``value`` when it is True or False (not 0/1 or a string)."""
    if not isinstance(value, bool):
        raise error(field, f"must be true or false, got {value!r}")
    return value


def check_text(field: str, value: Any, error: ErrorFactory) -> str:
    """``value`` when it is a non-empty string."""
    if not isinstance(value, str) or not value:
        raise error(field, f"must be a non-empty string, got {value!r}")
    return value


def check_choice(field: str, value: Any, choices: Iterable[Any], error: ErrorFactory) -> Any:
    """``value`` when it is one of ``choices``; else the valid ones and a did-you-mean."""
    choices = list(choices)
    if value not in choices:
        raise error(field, f"must be one of {choices}, got {value!r}{did_you_mean(value, choices)}")
    return value


def check_known(
    keys: Iterable[Any], known: Iterable[str], error: ErrorFactory, what: str = "key"
) -> None:
    """Raises for the first of ``keys`` not in ``known``, naming it, with a did-you-mean."""
    known = list(known)
    for key in keys:
        if key not in known:
            raise error(
                str(key), f"unknown {what}{did_you_mean(key, known)}; valid: {', '.join(known)}"
            )


def check_mesh_shape(field: str, value: Any, error: ErrorFactory) -> tuple[int, ...]:
    """``value`` as a (data, fsdp, tensor) or (data, fsdp, expert, tensor) tuple of positive
    integers, at most one of them -1."""
    shape = tuple(value) if isinstance(value, list | tuple) else None
    if (
        shape is None
        or len(shape) not in (3, 4)
        or not all(_is_int(s) for s in shape)
        or any(s == 0 or s < -1 for s in shape)
        or shape.count(-1) > 1
    ):
        raise error(
            field,
            "must be three positive integers (data, fsdp, tensor) or four (data, fsdp, expert, "
            f"tensor), at most one of them -1 for 'the remaining devices'; got {value!r}",
        )
    return shape  # type: ignore[return-value]
