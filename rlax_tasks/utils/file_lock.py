"""An exclusive advisory file lock between processes (the OS releases it if the holder dies)."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator


@contextlib.contextmanager
def exclusive(lock_path: str) -> Iterator[None]:
    """Holds an exclusive ``flock`` on ``lock_path`` (created if absent) for the block."""
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
