"""A pulled version's body into arrays, each block's CRC32C checked as soon as it lands.

Each block is read straight into its place in the array (a staging buffer only for a region not
contiguous there); each array is handed to ``place`` once complete, so at most one host buffer
is held beside the placed arrays. ``out``: an earlier pull's host arrays, reused. A delta stream
is rebuilt on the host copy of the version the client holds (``HeldVersion``)."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from rlax_tasks.paramserver.delta import apply_delta
from rlax_tasks.paramserver.placement import Placement
from rlax_tasks.paramserver.shared_memory import SegmentReader
from rlax_tasks.paramserver.wire import (
    END_FRAME_SIZE,
    ArraySpec,
    BlockHeader,
    ChecksumError,
    Manifest,
    WireError,
    block_header_size,
    check_coverage,
    crc32c,
    read_block_header,
    read_delta_header,
    read_end,
    read_manifest,
    resolve_dtype,
    version_digest,
)
from rlax_tasks.rundir.storage import read_into

Fill = Callable[[memoryview], int]  # writes a block's bytes into the view; returns their CRC32C


def receive_blocks(
    manifest: Manifest,
    blocks: Iterable[tuple[BlockHeader, Fill]],
    place: Callable[[str, np.ndarray], Any],
    out: dict[str, np.ndarray] | None = None,
) -> tuple[dict[str, Any], list[BlockHeader]]:
    """Fills host arrays from ``blocks`` ((header, fill) pairs in stream order), checking each
    block as it lands; each complete array goes through ``place(name, host)``. Returns
    ({name: placed array} in manifest order, the block headers)."""
    buffers = check_out(manifest, out) if out is not None else {}
    arrays: dict[str, Any] = {}
    headers: list[BlockHeader] = []
    scratch = np.empty(0, np.uint8)
    current, host, covered = -1, None, 0

    def host_array(spec: ArraySpec) -> np.ndarray:
        if spec.name in buffers:
            return buffers[spec.name]
        return np.empty(spec.shape, resolve_dtype(spec.dtype))

    def finish() -> None:
        spec = manifest.arrays[current]
        if covered != spec.nbytes:
            raise WireError(f"array {spec.name!r}: blocks cover {covered} of {spec.nbytes}")
        arrays[spec.name] = place(spec.name, host)

    for block_no, (header, fill) in enumerate(blocks):
        if header.array != current:
            if header.array < current or manifest.arrays[header.array].name in arrays:
                raise WireError("blocks of an array are not contiguous in the stream")
            if current >= 0:
                finish()
            current, covered = header.array, 0
            host = host_array(manifest.arrays[current])
        dest = host[header.region + (Ellipsis,)]
        staged = not dest.flags.c_contiguous
        if staged:  # a region not contiguous in the array: through a staging buffer
            if scratch.size < header.nbytes:
                scratch = np.empty(header.nbytes, np.uint8)
            view = memoryview(scratch[: header.nbytes])
        else:  # straight into its place
            view = memoryview(dest.reshape(-1).view(np.uint8))
        got = fill(view)
        if got != header.crc32c:
            raise ChecksumError(
                f"version {manifest.version}: block {block_no} of array "
                f"{manifest.arrays[current].name!r} fails its CRC32C (computed {got:#010x}, "
                f"sent {header.crc32c:#010x})"
            )
        if staged:
            np.copyto(dest, scratch[: header.nbytes].view(dest.dtype).reshape(header.shape))
        covered += header.nbytes
        headers.append(header)
    if current >= 0:
        finish()
    for spec in manifest.arrays:  # empty arrays have no blocks
        if spec.name not in arrays:
            if spec.nbytes:
                raise WireError(f"array {spec.name!r} received no blocks")
            arrays[spec.name] = place(spec.name, host_array(spec))
    return {spec.name: arrays[spec.name] for spec in manifest.arrays}, headers


def check_out_alone(out: Any, shardings: Any, like: Any) -> None:
    """``out`` is for host arrays only: placed arrays may alias their host buffers (on CPU), and
    the next pull into ``out`` would then change a version still in use."""
    if out is not None and (shardings is not None or like is not None):
        raise ValueError("out= receives into host arrays: pass it without shardings= or like=")


def check_out(manifest: Manifest, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``out`` checked against the version: the same names, each a writable C-contiguous numpy
    array of the array's shape and dtype (ValueError naming the first that is not)."""
    if not isinstance(out, dict):
        raise ValueError(f"out must be a dict of numpy arrays by name, got {type(out).__name__}")
    names = [a.name for a in manifest.arrays]
    missing, extra = sorted(set(names) - set(out)), sorted(set(out) - set(names))
    if missing or extra:
        raise ValueError(
            f"out does not match version {manifest.version}: missing {missing[:5]}, "
            f"not in the version {extra[:5]}"
        )
    for spec in manifest.arrays:
        buf = out[spec.name]
        dtype = resolve_dtype(spec.dtype)
        ok = (
            isinstance(buf, np.ndarray)
            and tuple(buf.shape) == spec.shape
            and buf.dtype == dtype
            and buf.flags.c_contiguous
            and buf.flags.writeable
        )
        if not ok:
            got = type(buf).__name__
            if isinstance(buf, np.ndarray):
                got = f"{buf.dtype}{list(buf.shape)}"
            raise ValueError(
                f"out[{spec.name!r}] is {got}; version {manifest.version} needs a writable "
                f"C-contiguous {dtype}{list(spec.shape)} numpy array"
            )
    return out


@dataclasses.dataclass(frozen=True)
class PullStats:
    """What the last pull moved: ``transport`` "tcp" or "shared memory"; ``base`` the version a
    delta was taken from (None: the whole version); ``nbytes`` the bytes received, against
    ``full_nbytes``, the whole version's stream."""

    version: int
    transport: str
    base: int | None
    nbytes: int
    full_nbytes: int


@dataclasses.dataclass
class HeldVersion:
    """The host copy of the version this client pulled last over TCP: the base of a delta."""

    manifest: Manifest
    headers: dict[tuple, BlockHeader]  # by (array, start, stop)
    buffers: dict[str, np.ndarray]
    digest: bytes

    @classmethod
    def of(
        cls, manifest: Manifest, headers: list[BlockHeader], buffers: dict, digest: bytes
    ) -> HeldVersion:
        """A verified version's host copy; ``digest``: its version digest (``read_end``)."""
        by_region = {(h.array, h.start, h.stop): h for h in headers}
        return cls(manifest, by_region, buffers, digest)


def receive_version(
    manifest: Manifest,
    blocks: Iterable[tuple[BlockHeader, Fill]],
    shardings: Any,
    like: Any,
    out: Any,
    copy: bool = False,
) -> tuple[Any, list[BlockHeader]]:
    """A version's blocks received and placed (``shardings`` / ``like``, checked against its
    manifest before any block is read): (params, block headers). ``copy``: place copies of the
    host arrays (``out`` is kept as the base of a delta; a placed array may alias its buffer)."""
    placement = Placement(manifest, shardings, like)
    place = (lambda name, host: placement.place(name, host.copy())) if copy else placement.place
    arrays, headers = receive_blocks(manifest, blocks, place, out)
    return placement.result(arrays), headers


def empty_buffers(manifest: Manifest) -> dict[str, np.ndarray]:
    """Host arrays for every array of a version, to receive it into."""
    return {a.name: np.empty(a.shape, resolve_dtype(a.dtype)) for a in manifest.arrays}


class Counting:
    """A response body that counts the bytes read from it (``count``)."""

    def __init__(self, raw: Any) -> None:
        self._raw, self.count = raw, 0

    def readinto(self, buf: memoryview) -> int:
        n = self._raw.readinto(buf)
        self.count += n
        return n

    def read(self, n: int = -1) -> bytes:
        data = self._raw.read(n)
        self.count += len(data)
        return data


def read_stream(
    resp: Counting, shardings: Any, like: Any, out: Any, held: HeldVersion | None, keep: bool
) -> tuple[int, Any, HeldVersion | None]:
    """A version's wire stream (verified) into placed arrays: (version, params, its host copy
    when ``keep``: received into ``held``'s buffers when they fit, placed as copies)."""
    manifest = read_manifest(resp)
    if keep:
        fits = held is not None and held.manifest.arrays == manifest.arrays
        out = held.buffers if fits else empty_buffers(manifest)

    def blocks() -> Any:
        for _ in range(manifest.num_blocks):
            header = read_block_header(resp, manifest)

            def fill(view: memoryview) -> int:
                read_into(resp, view)
                return crc32c(view)

            yield header, fill

    params, headers = receive_version(manifest, blocks(), shardings, like, out, copy=keep)
    digest = read_end(resp, manifest, headers)
    kept = HeldVersion.of(manifest, headers, out, digest) if keep else None
    return manifest.version, params, kept


def read_delta(
    resp: Counting, held: HeldVersion, shardings: Any, like: Any
) -> tuple[int, Any, HeldVersion, int]:
    """A delta stream rebuilt on ``held`` (in place; each block checked against the new
    version's CRC32C, the digest against the end frame) into placed copies: (version, params,
    the new host copy, the bytes the whole version's stream would have taken)."""
    manifest = read_manifest(resp)
    if manifest.base != held.manifest.version or manifest.arrays != held.manifest.arrays:
        raise WireError(
            f"a delta from version {manifest.base} for a client holding version "
            f"{held.manifest.version}"
        )
    placement = Placement(manifest, shardings, like)  # checked before any block is read

    def blocks() -> Any:
        payload = np.empty(0, np.uint8)
        for _ in range(manifest.num_blocks):
            header = read_delta_header(resp, manifest)
            if payload.size < header.nbytes:
                payload = np.empty(header.nbytes, np.uint8)
            data = payload[: header.nbytes]
            read_into(resp, memoryview(data))
            if crc32c(data) != header.crc32c:
                raise ChecksumError(
                    f"version {manifest.version}: a delta block of array "
                    f"{manifest.arrays[header.array].name!r} fails its CRC32C"
                )
            yield header, data

    headers = apply_delta(manifest, blocks(), held.buffers, held.headers)
    digest = read_end(resp, manifest, headers)
    check_coverage(manifest, headers)
    arrays = {
        spec.name: placement.place(spec.name, held.buffers[spec.name].copy())
        for spec in manifest.arrays
    }
    full = len(dataclasses.replace(manifest, base=None).encode()) + END_FRAME_SIZE
    full += sum(block_header_size(len(h.start)) + h.nbytes for h in headers)
    kept = HeldVersion.of(manifest, headers, held.buffers, digest)
    return manifest.version, placement.result(arrays), kept, full


def read_shared(
    descriptor: dict, segments: SegmentReader, shardings: Any, like: Any, out: Any
) -> tuple[int, Any, int]:
    """A version copied out of the server's shared memory (a descriptor: manifest, block
    headers, where each block lies) into placed arrays, each block's CRC32C and the digest
    checked as on TCP: (version, params, bytes copied)."""
    try:
        manifest = Manifest.from_json(descriptor["manifest"])
        raw_blocks = descriptor["blocks"]
        digest = bytes.fromhex(descriptor["digest"])
        where = descriptor["segments"]
        if len(raw_blocks) != manifest.num_blocks:
            raise WireError(f"{len(raw_blocks)} blocks for a manifest of {manifest.num_blocks}")
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"malformed shared-memory descriptor: {e!r}") from None
    with segments.reading(where, descriptor.get("live")) as copy:

        def blocks() -> Any:
            for raw, segment, offset in raw_blocks:
                header = read_block_header(io.BytesIO(bytes.fromhex(raw)), manifest)

                def fill(view: memoryview, segment: int = segment, offset: int = offset) -> int:
                    return copy(segment, offset, view)

                yield header, fill

        params, headers = receive_version(manifest, blocks(), shardings, like, out)
    if digest != version_digest(manifest, headers):
        raise WireError(
            f"version {manifest.version}: the descriptor's digest does not match its manifest "
            "and block headers"
        )
    return manifest.version, params, sum(h.nbytes for h in headers)
