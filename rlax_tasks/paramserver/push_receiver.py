"""Receiving a pushed version: a request body read block by block into its own buffers.

Each block lands straight in shared memory (or private memory) and its CRC32C is checked as soon
as it is in; a version becomes visible only once complete and valid (docs/design.md §6)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rlax_tasks.paramserver import shared_memory, wire
from rlax_tasks.paramserver.assembly import Assembly
from rlax_tasks.paramserver.errors import VersionTooLargeError
from rlax_tasks.paramserver.store import VersionStore
from rlax_tasks.paramserver.versions import Block, WeightVersion
from rlax_tasks.paramserver.wire import ChecksumError, Manifest, WireError
from rlax_tasks.rundir.storage import read_into

log = logging.getLogger(__name__)


class BoundedBody:
    """A reader that never reads past ``length`` bytes of a request body."""

    def __init__(self, raw: Any, length: int) -> None:
        self.raw, self.left = raw, length

    def readinto(self, buf: memoryview) -> int:
        if self.left <= 0:
            return 0
        view = buf[: self.left] if len(buf) > self.left else buf
        k = self.raw.readinto(view)
        self.left -= k or 0
        return k or 0

    def drain(self) -> None:
        """Reads and drops the rest of the body (a refused push): the client is still sending
        it, and closing on it would reset the connection before it reads the refusal."""
        scratch = memoryview(bytearray(1 << 20))
        while self.left > 0 and self.readinto(scratch):
            pass


def check_stream_length(manifest: Manifest, left: int) -> None:
    """VersionTooLargeError when the ``left`` bytes after the manifest exceed what its blocks
    and end frame can take: the arrays' bytes, a header per block (a block holds at least one
    byte, so at most that many headers) and the end frame."""
    ndim = max((len(a.shape) for a in manifest.arrays), default=0)
    headers = min(manifest.num_blocks, manifest.nbytes) * wire.block_header_size(ndim)
    most = manifest.nbytes + headers + wire.END_FRAME_SIZE
    if left > most:
        raise VersionTooLargeError(
            f"the body holds {left} bytes after the manifest of version {manifest.version}, "
            f"more than its {manifest.num_blocks} blocks of {manifest.nbytes} array bytes can "
            f"take ({most})"
        )


class PushReceiver:
    """Reads pushed wire streams into a ``VersionStore``; ``committed(weights, seconds)`` is
    called once each version is visible (the server logs and mirrors it)."""

    def __init__(
        self,
        store: VersionStore,
        segments: shared_memory.SegmentPool | None,
        verify: bool,
        committed: Callable[[WeightVersion, float], None],
    ) -> None:
        self.store, self.segments, self.verify = store, segments, verify
        self._committed = committed

    def receive_push(self, version: int, body: Any, length: int) -> WeightVersion:
        """Reads a pushed wire stream; the version becomes visible only once complete and valid."""
        self.store.begin_push(version)
        try:
            t0 = time.perf_counter()
            reader = BoundedBody(body, length)
            manifest = _read_manifest(reader, version)
            check_stream_length(manifest, reader.left)  # before any block is read
            self.store.fit_push(version, manifest.nbytes)  # its room, before any block arrives
            try:
                blocks = self._read_blocks(reader, manifest)
            except (ChecksumError, WireError):
                reader.drain()  # the rest of the body first: the pusher then reads our answer
                raise
            wire.check_coverage(manifest, (b.header for b in blocks))
            weights = WeightVersion(
                manifest, blocks, wire.version_digest(manifest, [b.header for b in blocks])
            )
            self.store.commit(weights)
            self._committed(weights, time.perf_counter() - t0)
            return weights
        finally:
            self.store.end_push(version)

    def receive_part(
        self, version: int, part: int, parts: int, body: Any, length: int
    ) -> WeightVersion:
        """Reads part ``part`` of ``parts`` of a multi-host version; returns once the version is
        committed (this part or another was the last), raises once it is abandoned."""
        t0 = time.perf_counter()
        assembly = self.store.begin_part(version, part, parts)
        try:
            reader = BoundedBody(body, length)
            try:
                manifest = _read_manifest(reader, version)
                self.store.start_part(assembly, part, manifest)
                check_stream_length(manifest, reader.left)  # before any block is read
                blocks = self._read_blocks(reader, manifest, assembly)
            except VersionTooLargeError as e:  # its body is never read: the version fails
                self.store.fail_part(assembly, part, e)
                raise
            except (ChecksumError, WireError) as e:  # a broken or corrupted part: no retry fixes it
                reader.drain()  # the rest of the body first: the pusher then reads our answer
                self.store.fail_part(assembly, part, e)  # raises the version's error
                raise
            digest = wire.version_digest(manifest, [b.header for b in blocks])
            weights = self.store.add_part(assembly, part, blocks, digest)
        finally:
            self.store.end_part_stream(assembly, part)
        if weights is None:
            log.info("version %d: part %d of %d in; waiting for the others", version, part, parts)
            return self.store.wait_assembled(assembly)
        self._committed(weights, time.perf_counter() - t0)
        return weights

    def _read_blocks(
        self, reader: BoundedBody, manifest: Manifest, assembly: Assembly | None = None
    ) -> list[Block]:
        """The blocks of one stream up to its end frame, each read straight into its own buffer
        and CRC32C-checked there as soon as it is in (``verify``); then the end frame's digest.

        Stops early when the version being assembled is abandoned meanwhile (its error)."""
        blocks: list[Block] = []
        covered = [0] * len(manifest.arrays)
        segment, offset = self._take_segment(reader.left), 0
        for block_no in range(manifest.num_blocks):
            if assembly is not None and assembly.error is not None:
                kind, message = assembly.error
                raise kind(message)
            header = wire.read_block_header(reader, manifest)
            spec = manifest.arrays[header.array]
            if covered[header.array] + header.nbytes > spec.nbytes:
                raise WireError(f"blocks of array {spec.name!r} exceed its {spec.nbytes} bytes")
            if header.nbytes > reader.left:  # never allocated beyond what the body still holds
                raise WireError(
                    f"block {block_no} of {header.nbytes} bytes, but the body has {reader.left} "
                    "left"
                )
            if segment is None:
                data = np.empty(header.nbytes, np.uint8)
            else:
                data = segment.data(offset, header.nbytes)
            read_into(reader, memoryview(data))
            if self.verify and (got := wire.crc32c(data)) != header.crc32c:
                raise ChecksumError(
                    f"block {block_no} (array {spec.name!r}) fails its CRC32C (computed "
                    f"{got:#010x}, sent {header.crc32c:#010x})"
                )
            covered[header.array] += header.nbytes
            blocks.append(Block(header, data, segment, offset))
            offset += header.nbytes
        wire.read_end(reader, manifest, [b.header for b in blocks])
        if reader.left:
            raise WireError(f"{reader.left} bytes after the end frame")
        if segment is not None:
            segment.stamp(manifest.version)  # complete and verified: same-host pulls may read it
        return blocks

    def _take_segment(self, nbytes: int) -> shared_memory.Segment | None:
        """Shared memory for a stream's blocks (at most ``nbytes``); None (private memory) when
        shared memory is off or full."""
        if self.segments is None:
            return None
        try:
            return self.segments.take(nbytes)
        except OSError as e:  # /dev/shm full or memfd refused: the bytes still arrive
            log.warning("no shared memory for %d bytes (%s); using private memory", nbytes, e)
            return None


def _read_manifest(reader: BoundedBody, version: int) -> Manifest:
    manifest = wire.read_manifest(reader)
    if manifest.version != version:
        raise WireError(f"manifest is for version {manifest.version}, URL for {version}")
    return manifest
