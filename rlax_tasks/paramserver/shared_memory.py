"""Versions in shared memory: a same-host worker copies a version out of the server's memory
(each block's CRC32C checked) instead of receiving it over TCP; pushes land in ``memfd``
segments that vanish with the process. Segments are recycled (faulting in fresh pages costs
more than the copy): a reader holds a shared flock and checks the stamp page, so a recycled
segment raises ``SegmentGoneError`` (pull again), never another version's bytes."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import google_crc32c
import numpy as np

from rlax_tasks.paramserver.wire import WireError
from rlax_tasks.services.endpoints import HOST_ADDRESS_ENV

log = logging.getLogger(__name__)

DATA_OFFSET = 4096  # the stamp's page; block data starts after it
_STAMP = struct.Struct("!4sQ16s")  # magic, version, nonce
_STAMP_MAGIC = b"RXS1"
_CLEARED = b"\0" * _STAMP.size
_SEGMENT_PATH = re.compile(r"/proc/\d+/fd/\d+")
COPY_CHUNK_BYTES = 1 << 20  # copy and CRC32C a block in L2-sized pieces: the CRC reads it hot


class SegmentGoneError(WireError):
    """The descriptor's segment no longer holds that version (recycled or released): pull again."""


def available() -> bool:
    """Whether this platform can share segments (Linux: memfd and /proc/<pid>/fd)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create")


_IDENTITY: str | None = None


def host_identity() -> str:
    """Who can open this process's segments: kernel boot id + pid and mount namespaces, and the
    slice host this process is on (``RLAX_HOST_ADDRESS``, set by the node agent: hosts of a slice
    never share memory, even where they share a kernel, as the fake Cloud TPU's hosts do)
    ('' where segments cannot be shared)."""
    global _IDENTITY
    if _IDENTITY is None:
        try:
            with open("/proc/sys/kernel/random/boot_id") as fh:
                boot = fh.read().strip()
            pid_ns = os.stat("/proc/self/ns/pid").st_ino
            mnt_ns = os.stat("/proc/self/ns/mnt").st_ino
            host = os.environ.get(HOST_ADDRESS_ENV, "")
            _IDENTITY = f"{boot}:{pid_ns}:{mnt_ns}:{host}" if available() else ""
        except OSError:
            _IDENTITY = ""
    return _IDENTITY


class Segment:
    """One shared-memory file of the server: a stamp page, then ``capacity`` bytes of blocks."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        fd = os.memfd_create("rlax-ps-version", os.MFD_CLOEXEC)
        self._finalizer = weakref.finalize(self, os.close, fd)  # never an fd leak
        self.fd = fd
        size = DATA_OFFSET + capacity
        os.posix_fallocate(fd, 0, size)  # the pages now: a full /dev/shm fails here, not later
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(fd, size, flags=flags)
        self._bytes = np.frombuffer(self._mm, np.uint8)
        self.inode = os.fstat(fd).st_ino
        self.nonce = b""
        self.version = -1
        self._pins = 0
        self._lock = threading.Lock()

    def data(self, offset: int, nbytes: int) -> np.ndarray:
        """The uint8 view of ``nbytes`` block bytes at ``offset`` (from the first block)."""
        if offset < 0 or offset + nbytes > self.capacity:
            raise WireError(f"{nbytes} bytes at {offset} overflow a {self.capacity}-byte segment")
        return self._bytes[DATA_OFFSET + offset : DATA_OFFSET + offset + nbytes]

    def stamp(self, version: int) -> None:
        """Marks the segment complete for ``version`` (readers check this stamp)."""
        self.nonce, self.version = secrets.token_bytes(16), version
        self._mm[: _STAMP.size] = _STAMP.pack(_STAMP_MAGIC, version, self.nonce)

    def pin(self) -> None:
        """One of this process's threads reads the segment: it is not recycled until unpinned."""
        with self._lock:
            self._pins += 1

    def unpin(self) -> None:
        with self._lock:
            self._pins -= 1

    def reclaim(self) -> bool:
        """Clears the stamp for reuse if no one reads the segment (pins, other processes'
        shared locks); False if someone does."""
        with self._lock:
            if self._pins:
                return False
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            try:
                self._mm[: _STAMP.size] = _CLEARED
                self.nonce, self.version = b"", -1
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)
            return True

    def describe(self) -> dict[str, Any]:
        """Where a same-host reader finds this segment, and the stamp it must carry."""
        return {
            "path": f"/proc/{os.getpid()}/fd/{self.fd}",
            "inode": self.inode,
            "size": DATA_OFFSET + self.capacity,
            "version": self.version,
            "nonce": self.nonce.hex(),
        }

    def is_open(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Closes the file: readers that have not opened it yet can no longer (the pages go
        once the last view of them is dropped)."""
        self._finalizer()


class SegmentPool:
    """Segments for incoming versions: a retired one (its version garbage-collected) is reused
    when it fits and nobody reads it; ``keep_free`` retired ones are kept, the rest closed."""

    def __init__(self, keep_free: int = 1) -> None:
        self.keep_free = keep_free
        self._free: list[Segment] = []
        self._all: weakref.WeakSet[Segment] = weakref.WeakSet()
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Segment:
        """A segment of at least ``nbytes``: a reclaimed free one (the smallest that fits), or a
        new one (OSError when shared memory is full)."""
        with self._lock:
            for segment in sorted(self._free, key=lambda s: s.capacity):
                if segment.capacity >= nbytes and segment.reclaim():
                    self._free.remove(segment)
                    return segment
        segment = Segment(nbytes)
        with self._lock:
            self._all.add(segment)
            count = sum(1 for s in self._all if s.is_open())
        log.info("new shared-memory segment of %.1f MB (%d open)", nbytes / 1e6, count)
        return segment

    def live_inodes(self) -> list[int]:
        """The inodes of the segments still open (readers may let go of the others)."""
        with self._lock:
            return [s.inode for s in list(self._all) if s.is_open()]

    def retire(self, segment: Segment) -> None:
        """``segment``'s version is gone: keep it for reuse, or close the oldest free one."""
        with self._lock:
            self._free.append(segment)
            while len(self._free) > self.keep_free:
                self._free.pop(0).close()

    def free_bytes(self) -> int:
        with self._lock:
            return sum(s.capacity for s in self._free)

    def drop_free(self) -> None:
        """Closes every free segment (their memory is needed for versions)."""
        with self._lock:
            for segment in self._free:
                segment.close()
            self._free.clear()


class SegmentReader:
    """A same-host client's view of the server's segments, kept mapped between pulls (a recycled
    segment is the same file, so a pull maps nothing new). Each read holds shared locks on its
    segments and checks their stamps first; segments the server no longer has open (``live``) are
    let go at the next read, and at most ``keep`` stay open."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._open: dict[tuple[str, int], _Mapped] = {}  # (path, inode): least recent first
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def reading(
        self, segments: list[dict[str, Any]], live: list[int] | None = None
    ) -> Iterator[Callable[[int, int, memoryview], int]]:
        """Locks and checks the described segments; yields ``copy(segment, offset, dest)``,
        which copies one block into ``dest`` and returns its CRC32C. SegmentGoneError when a
        segment no longer holds the version; OSError when it cannot be opened at all."""
        with self._lock:
            if live is not None:
                still_open = set(live)
                for key in [k for k in self._open if k[1] not in still_open]:
                    self._open.pop(key).close()
            mapped: list[_Mapped] = []
            try:
                for seg in segments:
                    m = self._mapped(seg)
                    fcntl.flock(m.fd, fcntl.LOCK_SH)  # the server recycles only under LOCK_EX
                    mapped.append(m)
                    m.check_stamp(seg)

                def copy(segment: int, offset: int, dest: memoryview) -> int:
                    if not 0 <= segment < len(mapped):
                        raise WireError(f"block names segment {segment} of {len(mapped)}")
                    return mapped[segment].copy_block(offset, dest)

                yield copy
            finally:
                for m in mapped:
                    fcntl.flock(m.fd, fcntl.LOCK_UN)

    def _mapped(self, seg: dict[str, Any]) -> _Mapped:
        key = (str(seg["path"]), int(seg["inode"]))
        m = self._open.pop(key, None)
        if m is None or m.size < int(seg["size"]):
            if m is not None:
                m.close()
            m = _Mapped(key[0], key[1], int(seg["size"]))
        self._open[key] = m  # now the most recent
        while len(self._open) > self.keep:
            self._open.pop(next(iter(self._open))).close()
        return m

    def close(self) -> None:
        with self._lock:
            while self._open:
                self._open.popitem()[1].close()


class _Mapped:
    """One segment opened read-only and mapped (populated: no page faults while copying)."""

    def __init__(self, path: str, inode: int, size: int) -> None:
        if not _SEGMENT_PATH.fullmatch(path):  # only another process's descriptor, no file
            raise WireError(f"descriptor names {path[:80]!r}, not a /proc/<pid>/fd/<n> segment")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SegmentGoneError(f"segment {path} is gone") from None
        try:
            st = os.fstat(fd)
            if st.st_ino != inode:  # the fd number now names another file
                raise SegmentGoneError(f"segment {path} was released")
            if st.st_size < size:
                raise SegmentGoneError(f"segment {path} is smaller than described")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._mm = mmap.mmap(fd, size, flags=flags, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.size = fd, size
        self._bytes = np.frombuffer(self._mm, np.uint8)

    def check_stamp(self, seg: dict[str, Any]) -> None:
        magic, version, nonce = _STAMP.unpack(self._mm[: _STAMP.size])
        if magic != _STAMP_MAGIC or version != seg["version"] or nonce.hex() != seg["nonce"]:
            raise SegmentGoneError(
                f"segment {seg['path']} no longer holds version {seg['version']}"
            )

    def copy_block(self, offset: int, dest: memoryview) -> int:
        """Copies one block's bytes into ``dest``; returns their CRC32C (computed piece by piece
        over ``dest`` right after each piece lands, while it is in cache)."""
        n = dest.nbytes
        start = DATA_OFFSET + offset
        if offset < 0 or start + n > self.size:
            raise WireError(f"block of {n} bytes at {offset} overflows its segment")
        dst = np.frombuffer(dest, np.uint8)
        crc = 0
        for lo in range(0, n, COPY_CHUNK_BYTES):
            hi = min(lo + COPY_CHUNK_BYTES, n)
            np.copyto(dst[lo:hi], self._bytes[start + lo : start + hi])
            crc = google_crc32c.extend(crc, dst[lo:hi])
        return crc

    def close(self) -> None:
        del self._bytes
        try:
            self._mm.close()
        except BufferError:  # a view still alive: the mapping goes with it
            pass
        os.close(self.fd)
