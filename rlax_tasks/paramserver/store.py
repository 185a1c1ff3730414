"""In-memory weight versions and worker bookkeeping of the parameter server (no I/O here).

A version is a list of blocks exactly as the trainer sent them (region + sha256 + bytes); the
server never re-lays-out or re-hashes data for a pull. The garbage-collection rule (DESIGN §6):
keep up to ``keep_versions`` versions; a version older than t is deleted only when every
registered worker has acknowledged a version >= t (workers that deregister or stop sending
heartbeats for ``worker_timeout_s`` no longer count). The newest version is never deleted.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from rlax_tasks.paramserver.wire import (
    END_FRAME_SIZE,
    BlockHeader,
    Manifest,
    block_header_size,
    end_frame,
)

log = logging.getLogger(__name__)


class VersionConflictError(ValueError):
    """A pushed version is not newer than the newest one (versions strictly increase)."""


class UnknownVersionError(KeyError):
    """The version asked for is not (or no longer) held in memory."""


@dataclasses.dataclass
class Block:
    header: BlockHeader
    data: np.ndarray  # uint8, header.nbytes long


@dataclasses.dataclass
class WeightVersion:
    """One complete version: manifest, blocks in stream order, and the version digest."""

    manifest: Manifest
    blocks: list[Block]
    digest: bytes

    @property
    def version(self) -> int:
        return self.manifest.version

    def frames(self) -> Iterator[bytes | memoryview]:
        """The wire stream of this version (manifest, block frames, end frame)."""
        yield self.manifest.encode()
        for b in self.blocks:
            yield b.header.encode()
            yield memoryview(b.data)
        yield end_frame(len(self.blocks), self.digest)

    def stream_length(self) -> int:
        n = len(self.manifest.encode()) + END_FRAME_SIZE
        for b in self.blocks:
            n += block_header_size(len(b.header.start)) + b.header.nbytes
        return n


@dataclasses.dataclass
class WorkerState:
    acked: int | None = None
    last_seen: float = 0.0


class VersionStore:
    """Versions in host memory and the workers that hold them; thread-safe."""

    def __init__(
        self,
        keep_versions: int,
        worker_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        self.keep_versions = keep_versions
        self.worker_timeout_s = worker_timeout_s
        self._clock = clock
        self._cond = threading.Condition()
        self._versions: dict[int, WeightVersion] = {}
        self._pushing: set[int] = set()
        self._workers: dict[str, WorkerState] = {}
        self._latest: int | None = None

    # ------------------------------------------------------------------ versions
    def latest(self) -> WeightVersion | None:
        with self._cond:
            return None if self._latest is None else self._versions[self._latest]

    def latest_version(self) -> int | None:
        with self._cond:
            return self._latest

    def versions(self) -> list[int]:
        with self._cond:
            return sorted(self._versions)

    def get(self, version: int) -> WeightVersion:
        with self._cond:
            try:
                return self._versions[version]
            except KeyError:
                raise UnknownVersionError(version) from None

    def wait_for(self, min_version: int | None, timeout_s: float) -> WeightVersion | None:
        """The newest version once it is >= min_version; None if that takes over timeout_s."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        with self._cond:
            while self._latest is None or (min_version is not None and self._latest < min_version):
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._versions[self._latest]

    def begin_push(self, version: int) -> None:
        """Reserves a version number for an incoming push (VersionConflictError if not newer)."""
        with self._cond:
            if self._latest is not None and version <= self._latest:
                raise VersionConflictError(
                    f"version {version} is not newer than the latest version {self._latest}"
                )
            if version in self._pushing:
                raise VersionConflictError(f"version {version} is already being pushed")
            self._pushing.add(version)

    def end_push(self, version: int) -> None:
        with self._cond:
            self._pushing.discard(version)

    def commit(self, weights: WeightVersion) -> list[int]:
        """Makes a complete version visible (wakes waiting pulls); returns GC'd version numbers."""
        with self._cond:
            v = weights.version
            if self._latest is not None and v <= self._latest:
                raise VersionConflictError(
                    f"version {v} is not newer than the latest version {self._latest}"
                )
            self._versions[v] = weights
            self._latest = v
            self._cond.notify_all()
            return self._gc_locked()

    # ------------------------------------------------------------------ workers
    def touch(self, worker_id: str) -> None:
        """Registers a worker on first contact and records that it is alive."""
        with self._cond:
            state = self._workers.get(worker_id)
            if state is None:
                state = self._workers[worker_id] = WorkerState()
                log.info("worker %s registered", worker_id)
            state.last_seen = self._clock()

    def ack(self, worker_id: str, version: int) -> list[int]:
        """The worker now holds ``version`` (it needs nothing older); returns GC'd versions."""
        with self._cond:
            if self._latest is None or version > self._latest:
                raise UnknownVersionError(version)
            self.touch(worker_id)
            self._workers[worker_id].acked = version
            return self._gc_locked()

    def deregister(self, worker_id: str) -> list[int]:
        with self._cond:
            if self._workers.pop(worker_id, None) is not None:
                log.info("worker %s deregistered", worker_id)
            return self._gc_locked()

    def expire_workers(self) -> tuple[list[str], list[int]]:
        """Drops workers silent for longer than worker_timeout_s; returns (dropped, GC'd)."""
        with self._cond:
            now = self._clock()
            gone = [
                w for w, s in self._workers.items() if now - s.last_seen > self.worker_timeout_s
            ]
            for w in gone:
                del self._workers[w]
                log.warning("worker %s timed out after %.1fs: released", w, self.worker_timeout_s)
            return gone, self._gc_locked()

    def workers(self) -> dict[str, dict]:
        with self._cond:
            now = self._clock()
            return {
                w: {"acked": s.acked, "idle_s": round(now - s.last_seen, 3)}
                for w, s in self._workers.items()
            }

    # ------------------------------------------------------------------ GC
    def _gc_locked(self) -> list[int]:
        """Deletes the oldest versions beyond keep_versions that no registered worker holds."""
        deleted = []
        held_from = self._hold_floor_locked()
        while len(self._versions) > self.keep_versions:
            oldest = min(self._versions)
            if oldest == self._latest or (held_from is not None and oldest >= held_from):
                break
            del self._versions[oldest]
            deleted.append(oldest)
        if deleted:
            log.info("garbage-collected versions %s", deleted)
        elif len(self._versions) > self.keep_versions:
            log.debug(
                "holding %d versions (> keep_versions=%d): workers still hold version %s",
                len(self._versions),
                self.keep_versions,
                held_from,
            )
        return deleted

    def _hold_floor_locked(self) -> int | None:
        """Versions >= this are held by some worker (-inf: a worker has acked nothing yet)."""
        if not self._workers:
            return None
        acks = [s.acked for s in self._workers.values()]
        if any(a is None for a in acks):
            return -(2**63)
        return min(acks)  # type: ignore[type-var]
