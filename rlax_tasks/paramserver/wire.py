"""Wire format of one weight version: a manifest, chunks ("blocks") of named arrays, an end frame.

The same byte stream is the body of a push (trainer -> server), of a pull (server -> worker) and
the content of the durable mirror, so the sha256 of every block is computed once, at the trainer,
and verified at every receiver (end to end):

    manifest frame  "RXM1" u64 len   JSON {"format", "version", "arrays": [{name, dtype, shape}],
                                           "num_blocks"}
    block frame     "RXB1" u32 array u32 ndim u64 nbytes sha256[32]  u64 start[ndim] u64 stop[ndim]
                    then ``nbytes`` raw bytes: the C-ordered region start:stop of that array
    end frame       "RXE1" u64 num_blocks  sha256[32] digest (sha256 of all block hashes, in order)

A block is a rectangular region of the global array that is contiguous in its source shard
(fixed leading indices, a range on one axis, full trailing axes), so a sharded jax.Array is sent
shard by shard without ever being gathered, and a receiver writes each block straight into its
place. All lengths are known before the first byte is sent (Content-Length, no chunked encoding).

A version's blocks tile every array exactly (``check_coverage``): no two regions overlap and
together they cover it. On a multi-host trainer each host sends a stream of the same shape holding
only its own shards' blocks (a *part*, with the manifest of the whole version but its own
``num_blocks`` and digest); the server serves the assembled version as one stream, blocks grouped
by array.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import BinaryIO

import numpy as np

from rlax_tasks.storage import read_into

FORMAT = 1
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
MAX_BLOCK_BYTES = 256 * 1024 * 1024
MAX_MANIFEST_BYTES = 64 * 1024 * 1024

_MANIFEST = struct.Struct("!4sQ")
_BLOCK = struct.Struct("!4sIIQ32s")
_END = struct.Struct("!4sQ32s")
_MANIFEST_MAGIC, _BLOCK_MAGIC, _END_MAGIC = b"RXM1", b"RXB1", b"RXE1"


class WireError(ValueError):
    """A malformed or inconsistent stream (bad frame, region, size or digest)."""


class ChecksumError(WireError):
    """A block's bytes do not match its sha256."""


def resolve_dtype(name: str) -> np.dtype:
    """numpy dtype from its name, including ml_dtypes' (``bfloat16``, float8 variants)."""
    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        kind = getattr(ml_dtypes, name, None)
        if kind is None:
            raise WireError(f"unknown dtype {name!r}") from None
        return np.dtype(kind)


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """Name, dtype name and global shape of one array of a version."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return resolve_dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a version holds: its number, its arrays (in stream order) and how many blocks follow."""

    version: int
    arrays: tuple[ArraySpec, ...]
    num_blocks: int

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": self.version,
            "arrays": [
                {"name": a.name, "dtype": a.dtype, "shape": list(a.shape)} for a in self.arrays
            ],
            "num_blocks": self.num_blocks,
        }

    @classmethod
    def from_json(cls, obj: dict) -> Manifest:
        try:
            if obj["format"] != FORMAT:
                raise WireError(
                    f"unsupported wire format {obj['format']} (this side speaks {FORMAT})"
                )
            arrays = tuple(
                ArraySpec(str(a["name"]), str(a["dtype"]), tuple(int(d) for d in a["shape"]))
                for a in obj["arrays"]
            )
            manifest = cls(int(obj["version"]), arrays, int(obj["num_blocks"]))
        except (KeyError, TypeError) as e:
            raise WireError(f"malformed manifest: {e!r}") from e
        names = [a.name for a in arrays]
        if len(set(names)) != len(names):
            raise WireError("manifest names an array twice")
        for a in arrays:
            resolve_dtype(a.dtype)
            if any(d < 0 for d in a.shape):
                raise WireError(f"array {a.name!r} has a negative dimension {a.shape}")
        if manifest.num_blocks < 0:
            raise WireError("negative block count")
        return manifest

    def encode(self) -> bytes:
        body = json.dumps(self.to_json(), separators=(",", ":")).encode()
        return _MANIFEST.pack(_MANIFEST_MAGIC, len(body)) + body


@dataclasses.dataclass(frozen=True)
class BlockHeader:
    """One block: which array, which region [start, stop) of it, how many bytes, their sha256."""

    array: int
    start: tuple[int, ...]
    stop: tuple[int, ...]
    nbytes: int
    sha256: bytes

    @property
    def region(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    def encode(self) -> bytes:
        ndim = len(self.start)
        fixed = _BLOCK.pack(_BLOCK_MAGIC, self.array, ndim, self.nbytes, self.sha256)
        return fixed + struct.pack(f"!{2 * ndim}Q", *self.start, *self.stop)


def block_header_size(ndim: int) -> int:
    return _BLOCK.size + 16 * ndim


def end_frame(num_blocks: int, digest: bytes) -> bytes:
    return _END.pack(_END_MAGIC, num_blocks, digest)


END_FRAME_SIZE = _END.size


def version_digest(block_hashes: Sequence[bytes]) -> bytes:
    """sha256 over the block hashes in stream order: one fingerprint of a whole version."""
    h = hashlib.sha256()
    for b in block_hashes:
        h.update(b)
    return h.digest()


def check_coverage(manifest: Manifest, headers: Iterable[BlockHeader]) -> None:
    """WireError naming the array unless the blocks tile every array exactly: no two regions
    overlap and together they cover it (an empty array has no blocks)."""
    regions: list[list[tuple[tuple[int, ...], tuple[int, ...]]]] = [[] for _ in manifest.arrays]
    for header in headers:
        regions[header.array].append((header.start, header.stop))
    for spec, boxes in zip(manifest.arrays, regions, strict=True):
        overlap = _first_overlap(boxes)
        if overlap is not None:
            (a0, a1), (b0, b1) = overlap
            raise WireError(
                f"array {spec.name!r}: regions {list(a0)}:{list(a1)} and {list(b0)}:{list(b1)} "
                "overlap (two blocks, or two hosts, sent the same elements)"
            )
        covered = sum(math.prod(b - a for a, b in zip(lo, hi, strict=True)) for lo, hi in boxes)
        if covered != math.prod(spec.shape):
            raise WireError(
                f"array {spec.name!r}: blocks cover {covered} of its "
                f"{math.prod(spec.shape)} elements {list(spec.shape)}"
            )


def _first_overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple | None:
    """Two overlapping boxes [start, stop) of ``boxes``, or None: a sweep along the axis with
    the most distinct starts, comparing each box only with those still open on that axis."""
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    if ndim == 0:
        return boxes[0], boxes[1]  # two blocks of a scalar
    axis = max(range(ndim), key=lambda d: len({lo[d] for lo, _ in boxes}))
    open_boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for box in sorted(boxes, key=lambda b: b[0][axis]):
        lo, hi = box
        open_boxes = [o for o in open_boxes if o[1][axis] > lo[axis]]
        for other in open_boxes:
            if all(a < d and c < b for a, b, c, d in zip(lo, hi, other[0], other[1], strict=True)):
                return other, box
        open_boxes.append(box)
    return None


def split_blocks(
    shape: Sequence[int], itemsize: int, max_bytes: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(start, stop) of each block of a C-contiguous array, in memory order, each <= max_bytes.

    A block takes as many whole slices along the outermost axis as fit; when one slice is too big
    it recurses into that slice. Only a single row of a huge last axis is cut element-wise.
    """
    shape = tuple(int(d) for d in shape)
    if max_bytes < itemsize:
        raise ValueError(f"chunk size {max_bytes} is smaller than one element ({itemsize} bytes)")
    if any(d == 0 for d in shape):
        return
    if not shape:
        yield (), ()
        return

    def rec(prefix: tuple[int, ...], dim: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
        inner = math.prod(shape[dim + 1 :]) * itemsize
        n = shape[dim]
        tail_start = (0,) * (len(shape) - dim - 1)
        tail_stop = shape[dim + 1 :]
        if inner <= max_bytes:
            step = max_bytes // inner
            for s in range(0, n, step):
                e = min(n, s + step)
                yield prefix + (s,) + tail_start, tuple(i + 1 for i in prefix) + (e,) + tail_stop
        else:
            for i in range(n):
                yield from rec(prefix + (i,), dim + 1)

    yield from rec((), 0)


def as_bytes(array: np.ndarray) -> memoryview:
    """A flat uint8 view of a C-contiguous array (copies only if it is not contiguous)."""
    return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


# --------------------------------------------------------------------------- reading
def read_manifest(fh: BinaryIO) -> Manifest:
    head = _read(fh, _MANIFEST.size)
    magic, length = _MANIFEST.unpack(head)
    if magic != _MANIFEST_MAGIC:
        raise WireError(f"stream does not start with a manifest (magic {magic!r})")
    if length > MAX_MANIFEST_BYTES:
        raise WireError(f"manifest of {length} bytes exceeds {MAX_MANIFEST_BYTES}")
    try:
        obj = json.loads(_read(fh, length))
    except ValueError as e:
        raise WireError(f"manifest is not JSON: {e}") from e
    return Manifest.from_json(obj)


def read_block_header(fh: BinaryIO, manifest: Manifest) -> BlockHeader:
    """The next block header, validated against the manifest (region inside the array, size)."""
    magic, array, ndim, nbytes, sha = _BLOCK.unpack(_read(fh, _BLOCK.size))
    if magic != _BLOCK_MAGIC:
        raise WireError(f"expected a block frame, got magic {magic!r}")
    if array >= len(manifest.arrays):
        raise WireError(f"block names array #{array}; the manifest has {len(manifest.arrays)}")
    spec = manifest.arrays[array]
    if ndim != len(spec.shape):
        raise WireError(f"block of {spec.name!r} has {ndim} dims, the array {len(spec.shape)}")
    coords = struct.unpack(f"!{2 * ndim}Q", _read(fh, 16 * ndim)) if ndim else ()
    start, stop = tuple(coords[:ndim]), tuple(coords[ndim:])
    if any(not (0 <= a < b <= d) for a, b, d in zip(start, stop, spec.shape, strict=True)):
        raise WireError(f"block region {start}:{stop} lies outside {spec.name!r} {spec.shape}")
    expected = math.prod(b - a for a, b in zip(start, stop, strict=True)) * spec.itemsize
    if nbytes != expected or nbytes > MAX_BLOCK_BYTES:
        raise WireError(f"block of {spec.name!r} declares {nbytes} bytes for {expected}")
    return BlockHeader(array, start, stop, nbytes, sha)


def read_end(fh: BinaryIO, manifest: Manifest, block_hashes: Sequence[bytes]) -> None:
    """Reads the end frame and checks the block count and the version digest."""
    magic, count, digest = _END.unpack(_read(fh, _END.size))
    if magic != _END_MAGIC:
        raise WireError(f"expected the end frame, got magic {magic!r}")
    if count != manifest.num_blocks or len(block_hashes) != count:
        raise WireError(f"end frame counts {count} blocks, received {len(block_hashes)}")
    if digest != version_digest(block_hashes):
        raise WireError("version digest does not match the block hashes")


def check_sha256(data: memoryview | bytes, expected: bytes) -> bool:
    return hashlib.sha256(data).digest() == expected


def _read(fh: BinaryIO, n: int) -> bytes:
    buf = bytearray(n)
    read_into(fh, memoryview(buf))
    return bytes(buf)
