"""One held weight version: its manifest, its blocks (in private or shared memory), its digest.

What the store keeps, the handler serves (``frames``) and the mirror writes (docs/design.md §6)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np

from rlax_tasks.paramserver.errors import VersionGoneError
from rlax_tasks.paramserver.shared_memory import Segment
from rlax_tasks.paramserver.wire import (
    END_FRAME_SIZE,
    BlockHeader,
    Manifest,
    block_header_size,
    end_frame,
)


@dataclasses.dataclass
class Block:
    """One block of a version: its header and bytes, and the shared memory they lie in."""

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
        """Bytes of ``frames()`` (a full pull's Content-Length)."""
        n = len(self.manifest.encode()) + END_FRAME_SIZE
        for b in self.blocks:
            n += block_header_size(len(b.header.start)) + b.header.nbytes
        return n
