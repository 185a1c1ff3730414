"""A periodic status line for long work: ``what: 120/200 rows (60%) 3.2/s eta 25s``.

Logged at INFO on the caller's logger (never a carriage-return bar: these jobs write to log
files), at most once every ``every_s`` seconds (``$RLAX_PROGRESS_EVERY_S``, else 5; 0 logs
every update), plus one final line. JAX-free."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import TypeVar

EVERY_ENV = "RLAX_PROGRESS_EVERY_S"
DEFAULT_EVERY_S = 5.0

T = TypeVar("T")
log = logging.getLogger(__name__)


def default_every_s() -> float:
    """Seconds between status lines: ``$RLAX_PROGRESS_EVERY_S``, else 5 (a bad value warns)."""
    raw = os.environ.get(EVERY_ENV, "").strip()
    if not raw:
        return DEFAULT_EVERY_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or math.isinf(value):
        log.warning("%s=%r is not a number of seconds >= 0; using %g", EVERY_ENV, raw,
                    DEFAULT_EVERY_S)  # fmt: skip
        return DEFAULT_EVERY_S
    return value


def format_duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def format_rate(per_s: float) -> str:
    """A rate with the digits that matter: ``1234``, ``12.3``, ``0.25``."""
    return f"{per_s:.0f}" if per_s >= 100 else f"{per_s:.1f}" if per_s >= 1 else f"{per_s:.2f}"


def format_si(n: float) -> str:
    """A count with an SI suffix: ``950``, ``12.3k``, ``7.62G``."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{suffix}"
    return _count(round(n, 2))


def _count(n: float) -> str:
    return str(int(n)) if float(n).is_integer() else f"{n:.4g}"


def _field(value: object) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class ProgressMeter:
    """Counts work done towards ``total`` (None: unknown) and logs a status line now and then.

    ``update(n, **fields)`` logs once ``every_s`` has passed since the last line, fields appended
    (``loss 0.41``); ``finish`` logs the final line once (``stopped at ...`` when a ``with`` block
    raised). ``format_count`` renders counts and rates (``12.0 MB``). Thread-safe."""

    def __init__(
        self,
        what: str,
        total: float | None = None,
        *,
        logger: logging.Logger,
        unit: str = "",
        every_s: float | None = None,
        format_count: Callable[[float], str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.what, self.total, self.logger = what, total, logger
        self.unit = f" {unit}" if unit else ""
        self.every_s = default_every_s() if every_s is None else max(0.0, float(every_s))
        self._format = format_count or _count
        self._clock = clock
        self.done: float = 0
        self.fields: dict[str, object] = {}
        self.start = self._last = clock()
        self.finished = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ counting
    def update(self, n: float = 1, **fields: object) -> bool:
        """Adds ``n`` done (and the latest ``fields``); returns whether a status line was logged."""
        with self._lock:
            self.done += n
            self.fields.update(fields)
            now = self._clock()
            if now - self._last < self.every_s or self.finished:
                return False
            self._last = now
            line = self._line(now)
        self.logger.info("%s", line)
        return True

    def track(self, items: Iterable[T], chunk: int = 256) -> Iterator[T]:
        """Yields ``items``, counting one per item done (in chunks, so a row costs little)."""
        pending = 0
        for item in items:
            yield item
            pending += 1
            if pending >= chunk:
                self.update(pending)
                pending = 0
        if pending:
            self.update(pending)

    def finish(self, note: str = "", **fields: object) -> None:
        """Logs the final line (``done in``, the mean rate, ``fields``, ``note``); once only."""
        with self._lock:
            if self.finished:
                return
            self.finished = True
            self.fields.update(fields)
            elapsed = self._clock() - self.start
            line = f"{self.what}: {self._counts()} done in {format_duration(elapsed)}"
            if elapsed > 0:
                line += f" ({self._rate(self.done / elapsed)})"
            line += self._fields() + (f" {note}" if note else "")
        self.logger.info("%s", line)

    # ------------------------------------------------------------------ the lines
    def line(self) -> str:
        """The status line as of now."""
        with self._lock:
            return self._line(self._clock())

    def _line(self, now: float) -> str:
        elapsed = now - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts = [f"{self.what}: {self._counts()}"]
        if self.total:
            parts[0] += f" ({100.0 * self.done / self.total:.0f}%)"
        parts.append(self._rate(rate))
        if self.total is None:
            parts.append(f"{format_duration(elapsed)} elapsed")
        elif rate > 0:
            parts.append(f"eta {format_duration(max(self.total - self.done, 0) / rate)}")
        else:
            parts.append("eta ?")
        return " ".join(parts) + self._fields()

    def _counts(self) -> str:
        if self.total is None:
            return f"{self._format(self.done)}{self.unit}"
        return f"{self._format(self.done)}/{self._format(self.total)}{self.unit}"

    def _rate(self, per_s: float) -> str:
        if self._format is _count:
            return f"{format_rate(per_s)}/s"
        return f"{self._format(per_s)}/s"

    def _fields(self) -> str:
        return "".join(f" {k} {_field(v)}" for k, v in self.fields.items())

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> ProgressMeter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finish()
        elif not self.finished:
            with self._lock:
                self.finished = True
                elapsed = self._clock() - self.start
            self.logger.info("%s: stopped at %s after %s (%s)", self.what, self._counts(),
                             format_duration(elapsed), exc_type.__name__)  # fmt: skip


__all__ = [
    "EVERY_ENV",
    "ProgressMeter",
    "default_every_s",
    "format_duration",
    "format_rate",
    "format_si",
]
