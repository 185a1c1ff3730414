"""Worker health: which workers take work now, which are backed off after a failure and until
when, and when each last made progress (the clock of ``worker_timeout_s``)."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable


class WorkerHealth:
    """Per-worker failure and progress book-keeping; the controller decides what to do."""

    def __init__(self, retry_s: float, clock: Callable[[], float]) -> None:
        self.retry_s, self.clock = retry_s, clock
        self.failures: collections.Counter[str] = collections.Counter()  # in a row, per worker
        self._down_until: dict[str, float] = {}
        self._answered: set[str] = set()  # workers that took work from this process
        self._last_progress: dict[str, float] = {}

    def live(self, workers: Iterable[str]) -> list[str]:
        """``workers`` less those backed off until later than now."""
        now = self.clock()
        return [w for w in workers if self._down_until.get(w, -math.inf) <= now]

    def down_until(self, worker: str) -> float:
        """The clock time before which ``worker`` gets no work (-inf: not backed off)."""
        return self._down_until.get(worker, -math.inf)

    def has_answered(self, worker: str) -> bool:
        """Whether ``worker`` took work from this process (else it may still be starting)."""
        return worker in self._answered

    def took_work(self, worker: str, was_idle: bool) -> None:
        """A submission went through: the worker is up; an idle one's timeout starts now."""
        self.failures.pop(worker, None)
        self._answered.add(worker)
        if was_idle:
            self._last_progress[worker] = self.clock()

    def returned(self, worker: str) -> None:
        """``worker`` handed back results: it is progressing."""
        self._last_progress[worker] = self.clock()
        self.failures.pop(worker, None)

    def idle_s(self, worker: str) -> float:
        """Seconds since ``worker`` last took work while idle or handed back results."""
        now = self.clock()
        return now - self._last_progress.get(worker, now)

    def back_off(self, worker: str) -> float:
        """Skips a worker for a while: soon at first (a worker starting up or restarting is back
        in seconds), then less and less often, up to ``retry_s``. Returns the delay."""
        self.failures[worker] += 1
        delay = min(self.retry_s, 0.25 * 2 ** (self.failures[worker] - 1))
        self._down_until[worker] = self.clock() + delay
        return delay

    def failed(self, worker: str) -> float:
        """``worker`` failed: backed off, its progress clock cleared. Returns the delay."""
        self._last_progress.pop(worker, None)
        return self.back_off(worker)
