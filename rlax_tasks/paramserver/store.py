"""In-memory weight versions and worker bookkeeping of the parameter server (no I/O here).

GC (docs/design.md §6): at most ``keep_versions`` versions and ``keep_bytes`` (pushes reserve theirs
first); a version goes only once every live worker acked a newer one, the newest never. A
multi-host version's parts gather in an ``Assembly``, committed once they tile every array."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from rlax_tasks.paramserver.shared_memory import Segment, SegmentPool
from rlax_tasks.paramserver.wire import (
    END_FRAME_SIZE,
    BlockHeader,
    Manifest,
    WireError,
    block_header_size,
    check_coverage,
    end_frame,
    version_digest,
)
from rlax_tasks.utils.byte_sizes import exact_bytes

log = logging.getLogger(__name__)


class VersionConflictError(ValueError):
    """A pushed version is not newer than the newest one (versions strictly increase)."""


class UnknownVersionError(KeyError):
    """The version asked for is not (or no longer) held in memory."""


class VersionGoneError(UnknownVersionError):
    """The version was garbage-collected and its shared memory reused before it could be read."""


class VersionTooLargeError(ValueError):
    """A pushed version can never fit in ``keep_bytes`` (the message names both numbers)."""


class NoRoomError(RuntimeError):
    """A push does not fit in ``keep_bytes`` yet: workers still hold the older versions."""


class PartsMissingError(RuntimeError):
    """Not every part of a multi-host version arrived within ``assembly_timeout_s`` of the first
    (the message names the version and the parts received and missing); it was discarded."""


@dataclasses.dataclass
class Block:
    header: BlockHeader
    data: np.ndarray  # uint8, header.nbytes long
    segment: Segment | None = None  # the shared memory ``data`` lies in (None: private memory)
    offset: int = 0  # where in the segment


@dataclasses.dataclass
class WeightVersion:
    """One complete version: manifest, blocks in stream order, and the version digest.

    ``part_digests``: for a version assembled from several hosts' parts, the digest of each part's
    own stream (what each host's end frame carried), by part; empty for a single-host push.
    """

    manifest: Manifest
    blocks: list[Block]
    digest: bytes
    part_digests: tuple[bytes, ...] = ()

    @property
    def version(self) -> int:
        return self.manifest.version

    def segments(self) -> list[Segment]:
        """The shared-memory segments its blocks lie in, in order of first use."""
        seen: dict[int, Segment] = {}
        for b in self.blocks:
            if b.segment is not None:
                seen.setdefault(id(b.segment), b.segment)
        return list(seen.values())

    def shared(self) -> bool:
        """Whether every block lies in shared memory (a same-host worker may read it there)."""
        return bool(self.blocks) and all(b.segment is not None for b in self.blocks)

    @contextlib.contextmanager
    def pinned(self) -> Iterator[WeightVersion]:
        """Reads of its bytes inside are safe: its segments are not recycled meanwhile.
        VersionGoneError if one already was (the version was garbage-collected)."""
        segments = self.segments()
        for segment in segments:
            segment.pin()
        try:
            if any(s.version != self.version for s in segments):
                raise VersionGoneError(self.version)
            yield self
        finally:
            for segment in segments:
                segment.unpin()

    def frames(self) -> Iterator[bytes | memoryview]:
        """The wire stream of this version (manifest, block frames, end frame); iterate it
        inside ``pinned()``."""
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


@dataclasses.dataclass
class _Push:
    """Room reserved for an incoming version; ``receiving`` once a push stream holds it."""

    nbytes: int = 0
    receiving: bool = False
    expires: float = float("inf")  # a reservation no stream has claimed lapses then (clock)


@dataclasses.dataclass(eq=False)
class Assembly:
    """A multi-host version being assembled from its parts (one per trainer host)."""

    version: int
    parts: int
    started: float  # time.monotonic() when the first part's stream began
    deadline: float  # every part must have arrived by then
    manifest: Manifest | None = None  # the first part's: every part must send the same arrays
    received: dict[int, tuple[list[Block], bytes]] = dataclasses.field(default_factory=dict)
    arrivals: int = 0  # complete part streams received, repeats included
    streaming: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    weights: WeightVersion | None = None  # once committed
    error: tuple[type[Exception], str] | None = None  # once abandoned: what every part gets


class VersionStore:
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

    def _joins_assembly_locked(self, version: int, parts: int | None) -> bool:
        assembly = self._assemblies.get(version)
        if parts is None or assembly is None:
            return False
        self._check_parts_locked(assembly, parts)
        return True

    def begin_push(self, version: int) -> None:
        """A push stream of ``version`` starts (claims its reservation, if any).

        VersionConflictError if not newer than the latest or already being received.
        """
        with self._cond:
            self._check_newer_locked(version)
            push = self._pushing.get(version)
            if push is not None and push.receiving:
                raise VersionConflictError(f"version {version} is already being pushed")
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

    # ------------------------------------------------------------------ multi-host parts
    def begin_part(self, version: int, part: int, parts: int) -> Assembly:
        """A stream of part ``part`` of ``parts`` of ``version`` starts; returns its assembly.

        The first part starts the assembly (claiming the reservation) and its timeout.
        VersionConflictError if not newer than the latest or pushed single-host; WireError
        (abandoning the assembly) if ``parts`` disagrees with the assembly's."""
        if not 0 <= part < parts:
            raise ValueError(f"part must be in [0, {parts}), got {part}")
        with self._cond:
            self._check_newer_locked(version)
            assembly = self._assemblies.get(version)
            if assembly is None:
                push = self._pushing.get(version)
                if push is not None and push.receiving:
                    raise VersionConflictError(
                        f"version {version} is already being pushed by a single-host push"
                    )
                if push is None:
                    push = self._pushing[version] = _Push()
                push.receiving, push.expires = True, float("inf")
                now = time.monotonic()
                assembly = Assembly(version, parts, now, now + self.assembly_timeout_s)
                self._assemblies[version] = assembly
                log.info("version %d: assembling %d parts (part %d first)", version, parts, part)
            self._check_parts_locked(assembly, parts)
            assembly.streaming[part] += 1
            return assembly

    def start_part(self, assembly: Assembly, part: int, manifest: Manifest) -> None:
        """A part's manifest arrived: the first sizes the version's room (at once, or
        NoRoomError), every later one must equal it (WireError naming the array). Either failure
        abandons the version."""
        with self._cond:
            self._raise_if_over_locked(assembly)
            v = assembly.version
            if assembly.manifest is not None:
                problem = _manifest_difference(assembly.manifest, manifest)
                if problem is not None:
                    self._abandon_locked(
                        assembly,
                        WireError,
                        f"part {part}'s manifest differs from the first part's: {problem}",
                    )
                    self._raise_if_over_locked(assembly)
                return
            push = self._pushing[v]
            try:
                if manifest.nbytes > push.nbytes and not self._make_room_locked(
                    v, manifest.nbytes, 0.0
                ):
                    raise NoRoomError(self._describe_locked(v, manifest.nbytes))
            except (NoRoomError, VersionTooLargeError, VersionConflictError) as e:
                self._abandon_locked(assembly, type(e), str(e))
                raise
            push.nbytes = manifest.nbytes
            assembly.manifest = manifest
            self._cond.notify_all()  # a smaller version frees room for the others

    def end_part_stream(self, assembly: Assembly, part: int) -> None:
        """A stream of ``part`` ended (arrived, broke or failed): no longer shown as streaming."""
        with self._cond:
            assembly.streaming[part] -= 1
            if assembly.streaming[part] <= 0:
                del assembly.streaming[part]

    def add_part(
        self, assembly: Assembly, part: int, blocks: list[Block], digest: bytes
    ) -> WeightVersion | None:
        """Part ``part`` arrived complete and verified (replacing an earlier copy of it).

        Returns the committed version after the last part (None before). Raises the version's
        error if abandoned, WireError (abandoning it) if the parts' regions overlap or leave a
        gap, VersionConflictError if it already committed."""
        with self._cond:
            self._raise_if_over_locked(assembly)
            v = assembly.version
            if part in assembly.received:
                log.info("version %d: part %d arrived again: it replaces the earlier copy", v, part)
            assembly.received[part] = (blocks, digest)
            assembly.arrivals += 1
            if len(assembly.received) < assembly.parts:
                return None
            try:
                weights = _assemble(assembly)
            except WireError as e:
                self._abandon_locked(assembly, WireError, str(e))
                raise
            del self._assemblies[v]  # committed below, not abandoned as an older assembly
            try:
                self._commit_locked(weights)
            except Exception as e:
                self._pushing.pop(v, None)
                self._abandon_locked(assembly, type(e), str(e))
                raise
            assembly.weights = weights
            self._cond.notify_all()
            log.info(
                "version %d assembled from %d parts in %.2fs",
                assembly.version,
                assembly.parts,
                time.monotonic() - assembly.started,
            )
            return weights

    def wait_assembled(self, assembly: Assembly) -> WeightVersion:
        """Waits until the version of ``assembly`` commits (returns it) or is abandoned (raises
        its error); abandons it (PartsMissingError) once its ``assembly_timeout_s`` is over."""
        with self._cond:
            while True:
                self._raise_if_over_locked(assembly, committed_ok=True)
                if assembly.weights is not None:
                    return assembly.weights
                left = assembly.deadline - time.monotonic()
                if left <= 0:
                    self._abandon_locked(
                        assembly, PartsMissingError, self._missing_message_locked(assembly)
                    )
                    continue
                self._cond.wait(left)

    def fail_part(self, assembly: Assembly, part: int, error: Exception) -> None:
        """A part's stream was malformed or corrupted: the version is abandoned with
        ``error``'s type, and every part waiting on it gets it; raises it here too."""
        with self._cond:
            if assembly.error is None and assembly.weights is None:
                self._abandon_locked(assembly, type(error), f"part {part}: {error}")
            self._raise_if_over_locked(assembly)

    def expire_assemblies(self) -> list[int]:
        """Abandons the versions whose parts did not all arrive in time; returns them."""
        with self._cond:
            now = time.monotonic()
            late = [a for a in self._assemblies.values() if now >= a.deadline]
            for assembly in late:
                self._abandon_locked(
                    assembly, PartsMissingError, self._missing_message_locked(assembly)
                )
            return [a.version for a in late]

    def assemblies(self) -> dict[str, dict]:
        """Versions being assembled: parts expected, received (and how many part streams
        arrived, repeats included) and streaming, bytes, age and time left."""
        with self._cond:
            now = time.monotonic()
            return {
                str(v): {
                    "parts": a.parts,
                    "received": sorted(a.received),
                    "arrivals": a.arrivals,
                    "streaming": sorted(a.streaming),
                    "bytes": None if a.manifest is None else a.manifest.nbytes,
                    "age_s": round(now - a.started, 3),
                    "timeout_in_s": round(max(a.deadline - now, 0.0), 3),
                }
                for v, a in sorted(self._assemblies.items())
            }

    def _check_parts_locked(self, assembly: Assembly, parts: int) -> None:
        if parts != assembly.parts:
            self._abandon_locked(
                assembly,
                WireError,
                f"a part says version {assembly.version} has {parts} parts, an earlier one "
                f"{assembly.parts} (every host must push with the same process count)",
            )
            self._raise_if_over_locked(assembly)

    def _raise_if_over_locked(self, assembly: Assembly, committed_ok: bool = False) -> None:
        if assembly.error is not None:
            kind, message = assembly.error
            raise kind(message)
        if assembly.weights is not None and not committed_ok:
            raise VersionConflictError(f"version {assembly.version} is already committed")

    def _abandon_locked(self, assembly: Assembly, kind: type[Exception], message: str) -> None:
        """Discards a version being assembled: its blocks and room go, its parts get ``kind``."""
        assembly.error = (kind, message)
        assembly.received.clear()
        if self._assemblies.get(assembly.version) is assembly:
            del self._assemblies[assembly.version]
            self._pushing.pop(assembly.version, None)
        log.warning("version %d abandoned: %s", assembly.version, message)
        self._cond.notify_all()

    def _missing_message_locked(self, assembly: Assembly) -> str:
        got = sorted(assembly.received)
        missing = [p for p in range(assembly.parts) if p not in assembly.received]
        shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
        return (
            f"version {assembly.version} abandoned: {len(got)} of {assembly.parts} parts arrived "
            f"within assembly_timeout_s={self.assembly_timeout_s:g}s of the first (missing parts: "
            f"{shown}; a trainer host did not push it); the partial version was discarded"
        )

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


def _manifest_difference(first: Manifest, other: Manifest) -> str | None:
    """Where a part's manifest differs from the first part's (naming the array), or None."""
    if first.arrays == other.arrays:
        return None
    for i, spec in enumerate(first.arrays):
        if i >= len(other.arrays):
            return f"array {spec.name!r} is missing"
        got = other.arrays[i]
        if got.name != spec.name:
            return f"array #{i} is {got.name!r}, in the first part {spec.name!r}"
        if got != spec:
            return (
                f"array {spec.name!r} is {got.dtype}{list(got.shape)}, in the first part "
                f"{spec.dtype}{list(spec.shape)}"
            )
    return f"array {other.arrays[len(first.arrays)].name!r} is not in the first part's manifest"


def _assemble(assembly: Assembly) -> WeightVersion:
    """The complete version of an assembly: blocks ordered by (array, part, stream order), so
    each array's blocks are contiguous in the served stream; WireError unless they tile every
    array exactly."""
    manifest = assembly.manifest
    assert manifest is not None  # a part's blocks arrive after its manifest
    ordered = [
        (block.header.array, part, i, block)
        for part, (blocks, _) in assembly.received.items()
        for i, block in enumerate(blocks)
    ]
    ordered.sort(key=lambda t: t[:3])
    blocks = [t[3] for t in ordered]
    check_coverage(manifest, (b.header for b in blocks))
    whole = Manifest(manifest.version, manifest.arrays, len(blocks))
    digest = version_digest(whole, [b.header for b in blocks])
    parts = tuple(assembly.received[p][1] for p in range(assembly.parts))
    return WeightVersion(whole, blocks, digest, parts)
