"""A server's outgoing link as a token bucket: every byte it sends waits for its share of
``rate`` bytes per second (docs/design.md §16).

For a fleet simulation on one machine, where each parameter-server replica stands for a host
with a NIC of its own, and for a server that must leave room on a shared link."""

from __future__ import annotations

import threading
import time
from typing import Any

# a write waits for at most this much of the bucket at a time, so concurrent pullers interleave
SLICE_BYTES = 256 * 1024


class TokenBucket:
    """``rate`` bytes per second shared by every thread that calls ``take``; a burst of at most
    ``burst`` bytes (default: a tenth of a second's worth) goes at once."""

    def __init__(self, rate: float, burst: float | None = None) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 bytes/s, got {rate!r}")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate / 10, SLICE_BYTES))
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        """Blocks until ``nbytes`` may be sent (the debt of a large take is paid by waiting)."""
        with self._lock:
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

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), SLICE_BYTES):
            piece = view[start : start + SLICE_BYTES]
            self.bucket.take(len(piece))
            self.raw.write(piece)
        return len(view)

    def __getattr__(self, name: str) -> Any:  # flush, close, closed: the socket file's own
        return getattr(self.raw, name)
