"""Math answer verifier: math-verify in isolated worker processes with hard timeouts.

`verify(response, reference)` (docs/design.md §9) returns 1.0 or 0.0; `MathVerifier.check_batch`
gives verdicts for many pairs with bounded parallelism and a result cache.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from rlax_tasks.rewards import _math_worker
from rlax_tasks.rewards.pool import IsolatedPool

logger = logging.getLogger(__name__)

VERDICTS = ("correct", "incorrect", "no_answer", "timeout", "error")
VERIFIER_VERSION = f"rlax-math/1+math-verify-{importlib.metadata.version('math-verify')}"
_MAX_RESPONSE_CHARS = 200_000


@dataclass(frozen=True)
class MathResult:
    """Verdict for one (response, reference) pair; reward is 1.0 only when "correct"."""

    reward: float
    verdict: str
    extracted: str | None = None
    cached: bool = False
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class _LRU:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[tuple, bool] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple) -> bool | None:
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self.hits += 1
                return self._data[key]
            self.misses += 1
            return None

    def put(self, key: tuple, value: bool) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self.capacity:
                self._data.popitem(last=False)


def _check_types(response: object, reference: object) -> None:
    if not isinstance(response, str):
        raise TypeError(f"response must be str, got {type(response).__name__}")
    if not isinstance(reference, str):
        raise TypeError(f"reference must be str, got {type(reference).__name__}")


class MathVerifier:
    """Pool of math-verify worker processes; each extraction or comparison has a hard
    wall-clock timeout, after which the worker is killed and replaced."""

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 5.0,
        *,
        cache_size: int = 100_000,
        worker_memory_mb: int | None = 4096,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s!r}")
        self.workers = workers or max(1, min(4, os.cpu_count() or 1))
        self.timeout_s = timeout_s
        self.version = VERIFIER_VERSION
        self._cache = _LRU(cache_size)
        self._pool = IsolatedPool(self.workers, _math_worker.init, memory_mb=worker_memory_mb)

    @property
    def cache_stats(self) -> dict[str, int]:
        return {
            "hits": self._cache.hits,
            "misses": self._cache.misses,
            "size": len(self._cache._data),
        }

    @property
    def workers_replaced(self) -> int:
        return self._pool.replaced

    def check(self, response: str, reference: str) -> MathResult:
        """Verdict for one pair (extraction, then cache lookup, then comparison)."""
        _check_types(response, reference)
        start = time.monotonic()
        if len(response) > _MAX_RESPONSE_CHARS:  # keep the tail, where the answer is
            response = response[-_MAX_RESPONSE_CHARS:]
        got = self._pool.call(_math_worker.extract, (response,), self.timeout_s)
        if got.status != "ok":
            return self._failed(got.status, got.error, None, start)
        extracted = got.value
        if extracted is None:
            return MathResult(0.0, "no_answer", None, False, time.monotonic() - start)
        key = (self.version, reference, extracted)
        hit = self._cache.get(key)
        if hit is not None:
            return self._result(hit, extracted, True, start)
        got = self._pool.call(_math_worker.compare, (reference, extracted), self.timeout_s)
        if got.status != "ok":
            return self._failed(got.status, got.error, extracted, start)
        self._cache.put(key, bool(got.value))
        return self._result(bool(got.value), extracted, False, start)

    def check_batch(
        self, pairs: Sequence[tuple[str, str]], max_parallel: int | None = None
    ) -> list[MathResult]:
        """Verdicts for many (response, reference) pairs, in order, at most
        `max_parallel` (default: the pool size) in flight."""
        pairs = list(pairs)
        for response, reference in pairs:
            _check_types(response, reference)
        if not pairs:
            return []
        parallel = max(1, min(max_parallel or self.workers, len(pairs)))
        with ThreadPoolExecutor(parallel, thread_name_prefix="rlax-math") as ex:
            return list(ex.map(lambda pair: self.check(*pair), pairs))

    def verify(self, response: str, reference: str) -> float:
        """1.0 if the response's final answer equals the reference, else 0.0."""
        return self.check(response, reference).reward

    @staticmethod
    def _result(ok: bool, extracted: str, cached: bool, start: float) -> MathResult:
        return MathResult(
            1.0 if ok else 0.0,
            "correct" if ok else "incorrect",
            extracted,
            cached,
            time.monotonic() - start,
        )

    @staticmethod
    def _failed(status: str, error: str, extracted: str | None, start: float) -> MathResult:
        logger.info("math check %s: %s", status, error)
        verdict = "timeout" if status == "timeout" else "error"
        return MathResult(0.0, verdict, extracted, False, time.monotonic() - start)

    def close(self) -> None:
        """Stop the worker processes."""
        self._pool.close()

    def __enter__(self) -> MathVerifier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default: MathVerifier | None = None
_default_lock = threading.Lock()


def get_default_verifier() -> MathVerifier:
    """Process-wide verifier used by `verify`, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier()
            atexit.register(_default.close)
        return _default


def verify(response: str, reference: str) -> float:
    """1.0 if the final answer in `response` is equivalent to `reference`, else 0.0."""
    return get_default_verifier().verify(response, reference)


def check_batch(
    pairs: Sequence[tuple[str, str]], max_parallel: int | None = None
) -> list[MathResult]:
    """Verdicts for many (response, reference) pairs with the default verifier."""
    return get_default_verifier().check_batch(pairs, max_parallel)
