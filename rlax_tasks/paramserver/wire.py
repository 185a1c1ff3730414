"""Wire format of one weight version: a manifest, blocks of named arrays, an end frame.

One byte stream is a push's body, a pull's and the mirror's content: each block's CRC32C is
computed once at the trainer and checked by every receiver. Blocks are regions contiguous in a
source shard, tiling every array exactly (``check_coverage``); a multi-host trainer sends parts."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from collections.abc import Iterable, Iterator, Sequence
from typing import BinaryIO

import google_crc32c
import ml_dtypes
import numpy as np

from rlax_tasks.rundir.storage import read_into

FORMAT = 2
LEGACY_FORMATS = (1,)  # read from mirrors, never sent
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024
MAX_BLOCK_BYTES = 256 * 1024 * 1024
MAX_MANIFEST_BYTES = 64 * 1024 * 1024

# manifest: "RXM1" u64 len, then JSON {"format", "version", "arrays": [{name, dtype, shape}],
# "num_blocks"} (the magic stays RXM1 in every format, so a receiver names the format it lacks)
_MANIFEST = struct.Struct("!4sQ")
# block: "RXB2" u32 array u32 ndim u64 nbytes u32 crc32c, u64 start[ndim] u64 stop[ndim], then
# nbytes raw bytes: the C-ordered region start:stop of that array (contiguous in its source shard)
_BLOCK = struct.Struct("!4sIIQI")
# delta block: "RXD2" u32 array u32 ndim u8 encoding u64 nbytes u32 crc32c u32 target crc32c, u64
# start[ndim] u64 stop[ndim], then nbytes of payload (rlax_tasks/paramserver/delta.py)
_DELTA = struct.Struct("!4sIIBQII")
# end: "RXE2" u64 num_blocks, sha256[32] version digest (version_digest)
_END = struct.Struct("!4sQ32s")
_MANIFEST_MAGIC, _BLOCK_MAGIC, _END_MAGIC, _DELTA_MAGIC = b"RXM1", b"RXB2", b"RXE2", b"RXD2"
# format 1, still read from old mirrors: a sha256 per block in place of its CRC32C, an end frame
# with sha256 over the block hashes; each block is checked, then given its CRC32C
_BLOCK_V1 = struct.Struct("!4sIIQ32s")
_END_V1 = struct.Struct("!4sQ32s")
_BLOCK_MAGIC_V1, _END_MAGIC_V1 = b"RXB1", b"RXE1"


class WireError(ValueError):
    """A malformed or inconsistent stream (bad frame, region, size or digest)."""


class ChecksumError(WireError):
    """A block's bytes do not match its CRC32C (or, in a format-1 mirror, its sha256)."""


def crc32c(data: memoryview | bytes | np.ndarray) -> int:
    """CRC32C of a contiguous buffer, read where it lies (no copy).

    ``google_crc32c.value`` refuses memoryviews but takes numpy arrays: a memoryview goes over as a
    zero-copy uint8 array. It holds the GIL below 1 MiB ``bytes``: a thread pool would not overlap
    it with receiving, so call it inline."""
    if isinstance(data, memoryview | bytearray):
        data = np.frombuffer(data, np.uint8)
    return google_crc32c.value(data)


def check_crc32c(data: memoryview | bytes | np.ndarray, expected: int) -> bool:
    """Whether ``data``'s CRC32C is ``expected``."""
    return crc32c(data) == expected


def resolve_dtype(name: str) -> np.dtype:
    """numpy dtype from its name, including ml_dtypes' (``bfloat16``, float8 variants)."""
    try:
        return np.dtype(name)
    except TypeError:
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
    """What a version holds: its number, its arrays (in stream order) and how many blocks follow.

    ``format``: the wire format of the frames that follow (only ``FORMAT`` is ever written);
    ``base``: a delta stream's base version (its frames are ``DeltaHeader``s), None otherwise."""

    version: int
    arrays: tuple[ArraySpec, ...]
    num_blocks: int
    format: int = FORMAT
    base: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def to_json(self) -> dict:
        obj = {
            "format": self.format,
            "version": self.version,
            "arrays": [
                {"name": a.name, "dtype": a.dtype, "shape": list(a.shape)} for a in self.arrays
            ],
            "num_blocks": self.num_blocks,
        }
        if self.base is not None:
            obj["base"] = self.base
        return obj

    @classmethod
    def from_json(cls, obj: dict, formats: Sequence[int] = (FORMAT,)) -> Manifest:
        """The manifest of a decoded JSON object; WireError unless its format is in ``formats``."""
        try:
            if obj["format"] not in formats or isinstance(obj["format"], bool):
                raise WireError(
                    f"unsupported wire format {obj['format']!r} (this side reads "
                    f"{', '.join(map(str, formats))})"
                )
            arrays = tuple(
                ArraySpec(str(a["name"]), str(a["dtype"]), tuple(int(d) for d in a["shape"]))
                for a in obj["arrays"]
            )
            base = obj.get("base")
            base = None if base is None else int(base)
            manifest = cls(int(obj["version"]), arrays, int(obj["num_blocks"]), obj["format"], base)
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
        if manifest.base is not None and manifest.base < 0:
            raise WireError(f"negative base version {manifest.base}")
        return manifest

    def encode(self) -> bytes:
        body = json.dumps(self.to_json(), separators=(",", ":")).encode()
        return _MANIFEST.pack(_MANIFEST_MAGIC, len(body)) + body


@dataclasses.dataclass(frozen=True)
class BlockRegion:
    """Which array a block belongs to, which region [start, stop) of it, how many bytes: what
    every format's block header says before its checksum."""

    array: int
    start: tuple[int, ...]
    stop: tuple[int, ...]
    nbytes: int

    @property
    def region(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))


@dataclasses.dataclass(frozen=True)
class BlockHeader(BlockRegion):
    """One block: its region (``BlockRegion``) and the CRC32C of its bytes."""

    crc32c: int

    def encode(self) -> bytes:
        ndim = len(self.start)
        fixed = _BLOCK.pack(_BLOCK_MAGIC, self.array, ndim, self.nbytes, self.crc32c)
        return fixed + struct.pack(f"!{2 * ndim}Q", *self.start, *self.stop)


@dataclasses.dataclass(frozen=True)
class DeltaHeader:
    """One block of a delta stream: the region [start, stop) of an array, how its ``payload``
    of ``nbytes`` (CRC32C ``crc32c``) rebuilds it from the base (``encoding``, one of
    rlax_tasks.paramserver.delta's), and ``target_crc32c``, the CRC32C of the rebuilt region."""

    array: int
    start: tuple[int, ...]
    stop: tuple[int, ...]
    encoding: int
    nbytes: int
    crc32c: int
    target_crc32c: int
    region_nbytes: int = 0  # the rebuilt region's size (known from the manifest; not sent)

    @property
    def region(self) -> tuple[slice, ...]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop, strict=True))

    def target(self) -> BlockHeader:
        """The header of the block it rebuilds: what a full stream would have sent."""
        return BlockHeader(
            self.array, self.start, self.stop, self.region_nbytes, self.target_crc32c
        )

    def encode(self) -> bytes:
        ndim = len(self.start)
        fixed = _DELTA.pack(
            _DELTA_MAGIC, self.array, ndim, self.encoding, self.nbytes, self.crc32c,
            self.target_crc32c,
        )  # fmt: skip
        return fixed + struct.pack(f"!{2 * ndim}Q", *self.start, *self.stop)


def block_header_size(ndim: int) -> int:
    return _BLOCK.size + 16 * ndim


def end_frame(num_blocks: int, digest: bytes) -> bytes:
    return _END.pack(_END_MAGIC, num_blocks, digest)


END_FRAME_SIZE = _END.size


def version_digest(manifest: Manifest, headers: Iterable[BlockHeader]) -> bytes:
    """sha256 over the manifest's arrays and every block header (region, size, CRC32C) in stream
    order: the fingerprint of a version's content (or one host's part), the same for the same
    weights blocked the same way in any version. It catches a damaged header or manifest the
    per-block CRCs cannot see. Integrity only: authenticity is the bearer token's."""
    h = hashlib.sha256(_arrays_identity(manifest))
    for header in headers:
        h.update(header.encode())
    return h.digest()


def _arrays_identity(manifest: Manifest) -> bytes:
    """The arrays of a manifest, canonically (not num_blocks: each part has its own; not the
    version number, which the server checks against the URL)."""
    arrays = [[a.name, a.dtype, list(a.shape)] for a in manifest.arrays]
    return json.dumps(arrays, separators=(",", ":")).encode()


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
def read_manifest(fh: BinaryIO, formats: Sequence[int] = (FORMAT,)) -> Manifest:
    """The manifest frame; WireError unless its format is one of ``formats`` (a mirror reader
    passes ``(FORMAT, *LEGACY_FORMATS)``, the wire only the current format)."""
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
    if not isinstance(obj, dict):
        raise WireError("manifest is not a JSON object")
    return Manifest.from_json(obj, formats)


def read_block_header(fh: BinaryIO, manifest: Manifest) -> BlockHeader:
    """The next block header, validated against the manifest (region inside the array, size)."""
    if manifest.format != FORMAT:
        raise WireError(f"a format-{manifest.format} stream: read it with read_block_header_v1")
    array, ndim, nbytes, crc = _read_frame(fh, _BLOCK, _BLOCK_MAGIC, "a block frame")
    start, stop = _read_region(fh, manifest, array, ndim, nbytes)
    return BlockHeader(array, start, stop, nbytes, crc)


def read_delta_header(fh: BinaryIO, manifest: Manifest) -> DeltaHeader:
    """The next block header of a delta stream, its region validated against the manifest."""
    array, ndim, encoding, nbytes, crc, target = _read_frame(
        fh, _DELTA, _DELTA_MAGIC, "a delta block"
    )
    start, stop, region_nbytes = _region(fh, manifest, array, ndim)
    if nbytes > MAX_BLOCK_BYTES:
        raise WireError(f"delta block of {manifest.arrays[array].name!r} declares {nbytes} bytes")
    return DeltaHeader(array, start, stop, encoding, nbytes, crc, target, region_nbytes)


def read_end(fh: BinaryIO, manifest: Manifest, headers: Sequence[BlockHeader]) -> bytes:
    """Reads the end frame and checks the block count and the version digest; returns it."""
    count, digest = _read_frame(fh, _END, _END_MAGIC, "the end frame")
    if count != manifest.num_blocks or len(headers) != count:
        raise WireError(f"end frame counts {count} blocks, received {len(headers)}")
    if digest != version_digest(manifest, headers):
        raise WireError(
            f"version {manifest.version}: the digest of the end frame does not match the "
            "manifest and block headers received (a header was damaged in transit)"
        )
    return digest


def _read_region(
    fh: BinaryIO, manifest: Manifest, array: int, ndim: int, nbytes: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(start, stop) of a block header, validated: the array exists, the region lies inside it
    and ``nbytes`` is its size."""
    start, stop, expected = _region(fh, manifest, array, ndim)
    if nbytes != expected or nbytes > MAX_BLOCK_BYTES:
        raise WireError(
            f"block of {manifest.arrays[array].name!r} declares {nbytes} bytes for {expected}"
        )
    return start, stop


def _region(
    fh: BinaryIO, manifest: Manifest, array: int, ndim: int
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """(start, stop, size in bytes) of a block header's region, validated: the array exists and
    the region lies inside it."""
    if array >= len(manifest.arrays):
        raise WireError(f"block names array #{array}; the manifest has {len(manifest.arrays)}")
    spec = manifest.arrays[array]
    if ndim != len(spec.shape):
        raise WireError(f"block of {spec.name!r} has {ndim} dims, the array {len(spec.shape)}")
    coords = struct.unpack(f"!{2 * ndim}Q", _read(fh, 16 * ndim)) if ndim else ()
    start, stop = tuple(coords[:ndim]), tuple(coords[ndim:])
    if any(not (0 <= a < b <= d) for a, b, d in zip(start, stop, spec.shape, strict=True)):
        raise WireError(f"block region {start}:{stop} lies outside {spec.name!r} {spec.shape}")
    return start, stop, math.prod(b - a for a, b in zip(start, stop, strict=True)) * spec.itemsize


# --------------------------------------------------------------------------- format 1 (read only)
@dataclasses.dataclass(frozen=True)
class BlockHeaderV1(BlockRegion):
    """A format-1 block header (mirrors written before format 2): the payload's sha256."""

    sha256: bytes


def read_block_header_v1(fh: BinaryIO, manifest: Manifest) -> BlockHeaderV1:
    """The next block header of a format-1 stream, validated like ``read_block_header``."""
    array, ndim, nbytes, sha = _read_frame(fh, _BLOCK_V1, _BLOCK_MAGIC_V1, "a format-1 block frame")
    start, stop = _read_region(fh, manifest, array, ndim, nbytes)
    return BlockHeaderV1(array, start, stop, nbytes, sha)


def read_end_v1(fh: BinaryIO, manifest: Manifest, block_hashes: Sequence[bytes]) -> None:
    """The end frame of a format-1 stream: block count, and sha256 over the block hashes."""
    count, digest = _read_frame(fh, _END_V1, _END_MAGIC_V1, "the format-1 end frame")
    if count != manifest.num_blocks or len(block_hashes) != count:
        raise WireError(f"end frame counts {count} blocks, received {len(block_hashes)}")
    if digest != hashlib.sha256(b"".join(block_hashes)).digest():
        raise WireError("version digest does not match the block hashes (format 1)")


def _read_frame(fh: BinaryIO, frame: struct.Struct, magic: bytes, what: str) -> tuple:
    """The fields after the magic of the next ``frame``; a WireError naming ``what`` was
    expected when the magic is another."""
    got, *fields = frame.unpack(_read(fh, frame.size))
    if got != magic:
        raise WireError(f"expected {what}, got magic {got!r}")
    return tuple(fields)


def _read(fh: BinaryIO, n: int) -> bytes:
    buf = bytearray(n)
    read_into(fh, memoryview(buf))
    return bytes(buf)
