"""In-memory weight versions and worker bookkeeping of the parameter server (no I/O here).

GC (docs/design.md §6): at most ``keep_versions`` versions and ``keep_bytes`` (pushes reserve theirs
first); a version goes only once every live worker acked a newer one, the newest never.
Multi-host versions' parts: ``assembly.PartAssembly``, the store's base class."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

from rlax_tasks.paramserver.assembly import Assembly, PartAssembly
from rlax_tasks.paramserver.errors import (
    NoRoomError,
    UnknownVersionError,
    VersionConflictError,
    VersionTooLargeError,
)
from rlax_tasks.paramserver.shared_memory import SegmentPool
from rlax_tasks.paramserver.versions import Block, WeightVersion
from rlax_tasks.utils.byte_sizes import exact_bytes

# Block and WeightVersion (owned by ``versions``): importable from here as before
__all__ = ["Assembly", "Block", "VersionStore", "WeightVersion", "WorkerState"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerState:
    acked: int | None = None
    last_seen: float = 0.0


@dataclasses.dataclass
class _Push:
    """Room reserved for an incoming version; ``receiving`` once a push stream holds it."""

    nbytes: int = 0
    receiving: bool = False
    expires: float = float("inf")  # a reservation no stream has claimed lapses then (clock)


class VersionStore(PartAssembly):
    """Versions in host memory and the workers that hold them; thread-safe."""

    def __init__(
        self,
        keep_versions: int,
        worker_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        keep_bytes: int | None = None,
        assembly_timeout_s: float = 600.0,
        segments: SegmentPool | None = None,
    ) -> None:
        """``segments``: where garbage-collected versions' shared memory goes for reuse (its
        spare segment is given up first when ``keep_bytes`` needs the room)."""
        if keep_versions < 1:
            raise ValueError(f"keep_versions must be >= 1, got {keep_versions}")
        if keep_bytes is not None and keep_bytes < 1:
            raise ValueError(f"keep_bytes must be >= 1 (or None: no limit), got {keep_bytes}")
        if not assembly_timeout_s > 0:
            raise ValueError(f"assembly_timeout_s must be > 0, got {assembly_timeout_s}")
        self.keep_versions = keep_versions
        self.assembly_timeout_s = assembly_timeout_s
        self.keep_bytes = keep_bytes
        self.worker_timeout_s = worker_timeout_s
        self._clock = clock
        self._cond = threading.Condition()
        self._versions: dict[int, WeightVersion] = {}
        self._pushing: dict[int, _Push] = {}
        self._assemblies: dict[int, Assembly] = {}  # multi-host versions being assembled
        self._waiting: collections.Counter = collections.Counter()  # versions waiting for room
        self._workers: dict[str, WorkerState] = {}
        self._latest: int | None = None
        self._segments = segments

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

    def reserve(
        self,
        version: int,
        nbytes: int,
        wait_s: float = 0.0,
        lease_s: float = 30.0,
        parts: int | None = None,
    ) -> None:
        """Reserves ``nbytes`` for a push of ``version``, waiting up to ``wait_s`` for room.

        ``begin_push``/``begin_part`` must claim it within ``lease_s``. NoRoomError (no room yet),
        VersionConflictError (not newer than the latest), VersionTooLargeError (can never fit).
        With ``parts`` the parts of a multi-host version share one reservation."""
        deadline = time.monotonic() + max(wait_s, 0.0)
        with self._cond:
            self._check_newer_locked(version)
            if self._joins_assembly_locked(version, parts):
                return
            push = self._pushing.get(version)
            if push is not None and push.receiving:
                raise VersionConflictError(f"version {version} is already being pushed")
            if not self._make_room_locked(version, nbytes, deadline):
                raise NoRoomError(self._describe_locked(version, nbytes))
            if self._joins_assembly_locked(version, parts):  # its first part began meanwhile
                return
            push = self._pushing.get(version)  # a stream may have started while we waited
            if push is not None and push.receiving:
                raise VersionConflictError(f"version {version} is already being pushed")
            self._pushing[version] = _Push(nbytes, False, self._clock() + lease_s)

    def begin_push(self, version: int) -> None:
        """A push stream of ``version`` starts (claims its reservation, if any).

        VersionConflictError if not newer than the latest or already being received.
        """
        with self._cond:
            self._check_newer_locked(version)
            self._claim_locked(version)

    def _claim_locked(self, version: int, by: str = "") -> None:
        """A push stream of ``version`` holds its reservation now (a new one if none was made);
        VersionConflictError if another stream already does (``by``: which kind, for the error)."""
        push = self._pushing.get(version)
        if push is not None and push.receiving:
            raise VersionConflictError(f"version {version} is already being pushed {by}".strip())
        if push is None:
            push = self._pushing[version] = _Push()
        push.receiving, push.expires = True, float("inf")

    def fit_push(self, version: int, nbytes: int, wait_s: float = 0.0) -> None:
        """Sizes the room of a push being received to its manifest's ``nbytes``.

        Within its reservation: at once. Beyond it: waits up to ``wait_s`` for room, then
        NoRoomError; VersionTooLargeError if the version can never fit."""
        deadline = time.monotonic() + max(wait_s, 0.0)
        with self._cond:
            push = self._pushing.get(version)
            if push is None or not push.receiving:
                raise RuntimeError(f"version {version} is not being received (call begin_push)")
            if nbytes > push.nbytes and not self._make_room_locked(version, nbytes, deadline):
                raise NoRoomError(self._describe_locked(version, nbytes))
            push.nbytes = nbytes
            self._cond.notify_all()  # a smaller push frees room for the others

    def end_push(self, version: int) -> None:
        """The stream of ``version`` ended (committed or not): its reservation is released."""
        with self._cond:
            self._pushing.pop(version, None)
            self._cond.notify_all()

    def commit(self, weights: WeightVersion) -> list[int]:
        """Makes a complete version visible (wakes waiting pulls); returns GC'd version numbers.

        A version committed without a push (a restored mirror) must fit in keep_bytes at once.
        Multi-host versions still being assembled that are not newer are abandoned.
        """
        with self._cond:
            return self._commit_locked(weights)

    def _commit_locked(self, weights: WeightVersion) -> list[int]:
        v = weights.version
        self._check_newer_locked(v)
        if v not in self._pushing and not self._make_room_locked(v, weights.manifest.nbytes, 0.0):
            raise NoRoomError(self._describe_locked(v, weights.manifest.nbytes))
        self._pushing.pop(v, None)  # its room now counts as a held version
        self._versions[v] = weights
        self._latest = v
        for older in [a for a in self._assemblies.values() if a.version <= v]:
            self._abandon_locked(
                older,
                VersionConflictError,
                f"version {older.version} can no longer be committed: version {v} was committed",
            )
        self._cond.notify_all()
        return self._gc_locked()

    def memory(self) -> dict:
        """Bytes of versions held and of pushes in flight, the limit, and who waits for room."""
        with self._cond:
            return {
                "keep_bytes": self.keep_bytes,
                "bytes_held": self._held_bytes_locked(),
                "bytes_in_flight": sum(p.nbytes for p in self._pushing.values()),
                # the spare shared-memory segment kept for the next push (counted in keep_bytes)
                "bytes_spare": 0 if self._segments is None else self._segments.free_bytes(),
                "pushes": {
                    str(v): {"bytes": p.nbytes, "receiving": p.receiving}
                    for v, p in sorted(self._pushing.items())
                },
                "waiting_for_room": sorted(self._waiting),
            }

    def _check_newer_locked(self, version: int) -> None:
        if self._latest is not None and version <= self._latest:
            raise VersionConflictError(
                f"version {version} is not newer than the latest version {self._latest}"
            )

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
            self._cond.notify_all()  # a push waiting for room may fit now
            return self._gc_locked()

    def deregister(self, worker_id: str) -> list[int]:
        with self._cond:
            if self._workers.pop(worker_id, None) is not None:
                log.info("worker %s deregistered", worker_id)
            self._cond.notify_all()
            return self._gc_locked()

    def expire_workers(self) -> tuple[list[str], list[int]]:
        """Drops workers silent for longer than worker_timeout_s (and lapsed reservations);
        returns (dropped workers, GC'd versions)."""
        with self._cond:
            self._expire_reservations_locked()
            now = self._clock()
            gone = [
                w for w, s in self._workers.items() if now - s.last_seen > self.worker_timeout_s
            ]
            for w in gone:
                del self._workers[w]
                log.warning("worker %s timed out after %.1fs: released", w, self.worker_timeout_s)
            if gone:
                self._cond.notify_all()
            return gone, self._gc_locked()

    def workers(self) -> dict[str, dict]:
        with self._cond:
            now = self._clock()
            return {
                w: {"acked": s.acked, "idle_s": round(now - s.last_seen, 3)}
                for w, s in self._workers.items()
            }

    # ------------------------------------------------------------------ GC
    def _gc_locked(self, need: int = 0, exclude: int | None = None) -> list[int]:
        """Deletes the oldest versions no registered worker holds while there are more than
        keep_versions, or while ``need`` bytes for push ``exclude`` would not fit in keep_bytes
        beside the rest."""
        deleted = []
        held_from = self._hold_floor_locked()
        while self._versions and (
            len(self._versions) > self.keep_versions
            or (need and self._in_use_locked(exclude) + need > self.keep_bytes)
        ):
            oldest = min(self._versions)
            if oldest == self._latest or (held_from is not None and oldest >= held_from):
                break
            gone = self._versions.pop(oldest)
            for segment in gone.segments():
                if need or self._segments is None:  # its room is wanted: no spare
                    segment.close()
                else:
                    self._segments.retire(segment)
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

    def _held_bytes_locked(self) -> int:
        return sum(w.manifest.nbytes for w in self._versions.values())

    def _in_use_locked(self, exclude: int | None = None) -> int:
        """Bytes of versions held, the room of pushes in flight (but ``exclude``'s) and the
        spare shared-memory segment kept for reuse."""
        reserved = sum(p.nbytes for v, p in self._pushing.items() if v != exclude)
        spare = 0 if self._segments is None else self._segments.free_bytes()
        return self._held_bytes_locked() + reserved + spare

    def _make_room_locked(self, version: int, nbytes: int, deadline: float) -> bool:
        """Frees room for ``nbytes`` of ``version`` (GC), waiting until ``deadline`` (monotonic)
        for acks; True when it fits beside everything else, False at the deadline."""
        if self.keep_bytes is None:
            return True
        t0, warned = time.monotonic(), False
        self._waiting[version] += 1  # several parts of one version may wait at once
        try:
            while True:
                self._expire_reservations_locked()
                self._check_newer_locked(version)  # a newer push may have committed meanwhile
                self._check_fits_ever_locked(version, nbytes)
                if version == min(self._waiting):  # lowest version first: no starving
                    if self._segments is not None and (
                        self._in_use_locked(exclude=version) + nbytes > self.keep_bytes
                    ):
                        self._segments.drop_free()  # the spare goes before any version
                    self._gc_locked(need=nbytes, exclude=version)
                    if self._in_use_locked(exclude=version) + nbytes <= self.keep_bytes:
                        if warned:
                            log.info(
                                "version %d fits after waiting %.1fs for room",
                                version,
                                time.monotonic() - t0,
                            )
                        return True
                left = deadline - time.monotonic()
                if not warned:
                    log.warning("%s", self._describe_locked(version, nbytes))
                    warned = True
                if left <= 0:
                    return False
                self._cond.wait(left)
        finally:
            self._waiting[version] -= 1
            if self._waiting[version] <= 0:
                del self._waiting[version]
            self._cond.notify_all()  # the next waiting version may go now

    def _check_fits_ever_locked(self, version: int, nbytes: int) -> None:
        """VersionTooLargeError when no acknowledgement could ever make room for the push."""
        limit = self.keep_bytes
        if nbytes > limit:
            raise VersionTooLargeError(
                f"version {version} is {exact_bytes(nbytes)}, more than keep_bytes="
                f"{exact_bytes(limit)}: it can never be held; raise --keep-bytes"
            )
        earlier = [v for v in (*self._pushing, *self._waiting) if v < version]
        if self._latest is None or earlier:
            return  # an earlier push will replace the newest version: wait for it
        newest = self._versions[self._latest].manifest.nbytes
        if nbytes + newest > limit:
            raise VersionTooLargeError(
                f"version {version} is {exact_bytes(nbytes)} and the newest version "
                f"{self._latest} ({exact_bytes(newest)}) stays in memory until version "
                f"{version} is committed: {nbytes} + {newest} > keep_bytes={exact_bytes(limit)}; "
                "keep_bytes must hold two versions"
            )

    def _expire_reservations_locked(self) -> None:
        now = self._clock()
        lapsed = [v for v, p in self._pushing.items() if not p.receiving and now > p.expires]
        for v in lapsed:
            log.warning("reservation for version %d lapsed: no push stream claimed it", v)
            del self._pushing[v]
        if lapsed:
            self._cond.notify_all()

    def _describe_locked(self, version: int, nbytes: int) -> str:
        """Which version waits, for how many bytes, what is held and by which workers."""
        held = ", ".join(
            f"{v} ({w.manifest.nbytes} bytes{', newest' if v == self._latest else ''})"
            for v, w in sorted(self._versions.items())
        )
        pushes = ", ".join(
            f"{v} ({p.nbytes} bytes)" for v, p in sorted(self._pushing.items()) if v != version
        )
        holders = [
            f"{w} (acked {'nothing' if s.acked is None else s.acked})"
            for w, s in sorted(self._workers.items())
            if s.acked is None or (self._latest is not None and s.acked < self._latest)
        ]
        text = (
            f"version {version} waits for room: needs {exact_bytes(nbytes)}, keep_bytes="
            f"{exact_bytes(self.keep_bytes)}; held: versions [{held}] = "
            f"{self._held_bytes_locked()} bytes, pushes in flight [{pushes}]"
        )
        if holders and self._versions:
            floor = max(self._hold_floor_locked(), min(self._versions))
            text += (
                f"; versions from {floor} on are held by workers "
                f"{', '.join(holders)} until they acknowledge a newer version (or deregister / "
                f"time out after {self.worker_timeout_s:g}s)"
            )
        return text

    def _hold_floor_locked(self) -> int | None:
        """Versions >= this are held by some worker (-inf: a worker has acked nothing yet)."""
        if not self._workers:
            return None
        acks = [s.acked for s in self._workers.values()]
        if any(a is None for a in acks):
            return -(2**63)
        return min(acks)  # type: ignore[type-var]
