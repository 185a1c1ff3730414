"""Python's full garbage collections, at moments a long-running process chooses.

A run holds many long-lived objects; an automatic full collection walks them all and stalls a
step. ``defer_full_collections`` takes full collections over, ``freeze_startup`` exempts what
start-up loaded, ``collect_if_due`` runs one at step boundaries. Nothing runs unless called."""

from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger(__name__)

DEFAULT_EVERY_S = 60.0
_NEVER = 2**31 - 1  # a generation-2 threshold the collector never reaches

_lock = threading.Lock()
_every_s: float | None = None  # None: full collections are the automatic collector's
_last = 0.0
_saved_thresholds: tuple[int, int, int] | None = None


def defer_full_collections(every_s: float = DEFAULT_EVERY_S) -> None:
    """Takes full collections away from the automatic collector; ``collect_if_due`` runs them,
    at most every ``every_s`` seconds."""
    global _every_s, _last, _saved_thresholds
    if every_s <= 0:
        raise ValueError(f"every_s must be positive, got {every_s}")
    with _lock:
        if _saved_thresholds is None:
            _saved_thresholds = gc.get_threshold()
        young, middle, _ = _saved_thresholds
        gc.set_threshold(young, middle, _NEVER)
        _every_s, _last = every_s, time.monotonic()


def freeze_startup() -> int:
    """Moves every object alive now to the permanent generation (``gc.freeze``): collections no
    longer walk what start-up loaded. Returns how many objects are frozen."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze %d start-up objects out of the garbage collector's walks", frozen)
    return frozen


def collect_if_due(now: float | None = None) -> float | None:
    """A full collection when ``every_s`` passed since the last (and full collections are
    deferred); returns the seconds it took, or None when none ran."""
    global _last
    now = time.monotonic() if now is None else now
    with _lock:
        if _every_s is None or now - _last < _every_s:
            return None
        _last = now
    t0 = time.perf_counter()
    freed = gc.collect()
    took = time.perf_counter() - t0
    log.debug("full garbage collection: %d objects freed in %.3fs", freed, took)
    return took


def restore_defaults() -> None:
    """Hands full collections back to the automatic collector and unfreezes (tests)."""
    global _every_s, _saved_thresholds
    with _lock:
        if _saved_thresholds is not None:
            gc.set_threshold(*_saved_thresholds)
        _every_s, _saved_thresholds = None, None
    gc.unfreeze()
