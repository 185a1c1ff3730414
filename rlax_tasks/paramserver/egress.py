"""A server's outgoing link as a token bucket: every byte it sends waits for its share of
``rate`` bytes per second (docs/design.md §16).

For a fleet simulation on one machine, where each parameter-server replica stands for a host
with a NIC of its own, and for a server that must leave room on a shared link."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

# a write waits for at most this much of the bucket at a time, so concurrent pullers interleave
SLICE_BYTES = 256 * 1024


class TokenBucket:
    """``rate`` bytes per second shared by every thread that calls ``take``; a burst of at most
    ``burst`` bytes (default: a tenth of a second's worth) goes at once. While a stream marked
    ``first`` sends (a replica relaying a version), the others wait: the replicas get a new
    version at the link's full rate and serve their workers in parallel sooner."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate / 10, SLICE_BYTES))
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Condition()
        self._first = 0  # streams marked first, sending now

    @contextlib.contextmanager
    def first(self) -> Iterator[None]:
        """Inside, ``take(first=True)`` goes before every other taker."""
        with self._lock:
            self._first += 1
        try:
            yield
        finally:
            with self._lock:
                self._first -= 1
                self._lock.notify_all()

    def take(self, nbytes: int, first: bool = False) -> None:
        """Blocks until ``nbytes`` may be sent (the debt of a large take is paid by waiting);
        others than ``first`` takers wait while a ``first`` stream sends."""
        with self._lock:
            while not first and self._first:
                self._lock.wait()
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)


class ThrottledWriter:
    """A socket's write file whose every byte passes ``bucket`` first, in slices."""

    def __init__(self, raw: Any, bucket: TokenBucket) -> None:
        self.raw, self.bucket = raw, bucket
        self.first = False  # this connection's stream goes before the others (``first``)

    @contextlib.contextmanager
    def sending_first(self) -> Iterator[None]:
        """What is written inside goes before every other connection's bytes."""
        with self.bucket.first():
            self.first = True
            try:
                yield
            finally:
                self.first = False

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), SLICE_BYTES):
            piece = view[start : start + SLICE_BYTES]
            self.bucket.take(len(piece), first=self.first)
            self.raw.write(piece)
        return len(view)

    def __getattr__(self, name: str) -> Any:  # flush, close, closed: the socket file's own
        return getattr(self.raw, name)
