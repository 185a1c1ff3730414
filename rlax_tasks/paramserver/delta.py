"""Delta pulls (docs/design.md §6): a version sent as what changed since a base version the worker
holds.

Each block of the new version goes as ``SAME`` (its bytes equal the base's block of the same
region: nothing sent), ``SPARSE`` (the positions and new values of the elements whose bits
changed) or ``WHOLE`` (its bytes, when that is no larger). Every block carries the CRC32C of the
region it rebuilds, checked once applied: the result is the new version bit for bit, or refused.
At RL learning rates a bf16 step flips a few percent of the elements, which SPARSE sends in about
two bytes each beside their values; a block-level diff would send every block."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator

import numpy as np

from rlax_tasks.paramserver.wire import (
    BlockHeader,
    ChecksumError,
    DeltaHeader,
    Manifest,
    WireError,
    crc32c,
    end_frame,
)

PAGE = 1 << 16  # elements per page: a position inside a page fits in a uint16


class Encoding(enum.IntEnum):
    """How a delta block's payload rebuilds its region from the base."""

    SAME = 0  # no payload: the base's block of this region, unchanged
    SPARSE = 1  # per page of PAGE elements a u32 count, then u16 positions, then the new values
    WHOLE = 2  # the region's bytes


def _elements(data: np.ndarray, itemsize: int) -> np.ndarray:
    """A flat uint8 buffer seen as unsigned integers of ``itemsize`` bytes: elements compared by
    their bits (NaNs and signed zeros included)."""
    return data.view(np.dtype(f"u{itemsize}")) if itemsize in (1, 2, 4, 8) else data


def sparse_payload(base: np.ndarray, new: np.ndarray, itemsize: int) -> bytes | None:
    """The SPARSE payload rebuilding ``new`` from ``base`` (flat uint8 buffers of one region): b""
    when no element changed, None when it would not be smaller than ``new`` itself."""
    old_el, new_el = _elements(base, itemsize), _elements(new, itemsize)
    if old_el is base:  # an element size with no integer view: compared byte by byte
        itemsize = 1
    changed = np.flatnonzero(old_el != new_el)
    if not changed.size:
        return b""
    pages = -(-new_el.size // PAGE)
    size = 4 * pages + changed.size * (2 + itemsize)
    if size >= new.size:
        return None
    counts = np.bincount(changed >> 16, minlength=pages).astype("<u4")
    positions = (changed & (PAGE - 1)).astype("<u2")
    return counts.tobytes() + positions.tobytes() + new_el[changed].tobytes()


def apply_sparse(region: np.ndarray, payload: np.ndarray, itemsize: int) -> None:
    """Writes a SPARSE payload into ``region`` (a flat, writable uint8 buffer holding the base's
    bytes); WireError when the payload does not fit the region."""
    elements = _elements(region, itemsize)
    if elements is region:
        itemsize = 1
    pages = -(-elements.size // PAGE)
    if payload.size < 4 * pages:
        raise WireError(f"sparse block of {payload.size} bytes is shorter than its page counts")
    counts = payload[: 4 * pages].view("<u4")
    total = int(counts.sum(dtype=np.int64))
    if payload.size != 4 * pages + total * (2 + itemsize):
        raise WireError(
            f"sparse block of {payload.size} bytes does not hold {total} changes of "
            f"{itemsize}-byte elements"
        )
    positions = payload[4 * pages : 4 * pages + 2 * total].view("<u2").astype(np.int64)
    positions += np.repeat(np.arange(pages, dtype=np.int64) * PAGE, counts)
    if total and int(positions.max()) >= elements.size:
        raise WireError(f"sparse block changes element {int(positions.max())} of {elements.size}")
    elements[positions] = payload[4 * pages + 2 * total :].view(elements.dtype)


def delta_block(
    target: BlockHeader, new: np.ndarray, base: tuple[BlockHeader, np.ndarray] | None, itemsize: int
) -> tuple[DeltaHeader, bytes | np.ndarray]:
    """The delta frame of one block of the new version (``new``: its bytes) against the base's
    block of the same region (None: the base has none), and its payload."""
    encoding, payload = Encoding.WHOLE, new
    if base is not None:
        sparse = sparse_payload(base[1], new, itemsize)
        if sparse == b"":
            encoding, payload = Encoding.SAME, sparse
        elif sparse is not None:
            encoding, payload = Encoding.SPARSE, sparse
    size = len(payload) if isinstance(payload, bytes) else payload.size
    header = DeltaHeader(
        target.array, target.start, target.stop, encoding, size, crc32c(payload), target.crc32c,
        target.nbytes,
    )  # fmt: skip
    return header, payload


def delta_frames(
    manifest: Manifest,
    blocks: list[tuple[BlockHeader, np.ndarray]],
    base_version: int,
    base_blocks: list[tuple[BlockHeader, np.ndarray]],
    digest: bytes,
) -> Iterator[bytes | np.ndarray]:
    """The wire stream of a version (``blocks``: its headers and bytes, ``digest`` its version
    digest) as a delta against ``base_blocks``: a manifest naming the base, one delta frame per
    block, the version's own end frame."""
    itemsizes = [a.itemsize for a in manifest.arrays]
    by_region = {(h.array, h.start, h.stop): (h, data) for h, data in base_blocks}
    head = Manifest(manifest.version, manifest.arrays, len(blocks), base=base_version)
    yield head.encode()
    for target, data in blocks:
        base = by_region.get((target.array, target.start, target.stop))
        header, payload = delta_block(target, data, base, itemsizes[target.array])
        yield header.encode()
        if header.nbytes:
            yield payload
    yield end_frame(len(blocks), digest)


def apply_block(
    header: DeltaHeader,
    payload: np.ndarray,
    region: np.ndarray,
    base: BlockHeader | None,
    itemsize: int,
    name: str,
) -> None:
    """Rebuilds one region of the held base (``region``: its flat, writable uint8 bytes) from a
    delta block whose payload passed its CRC32C; ChecksumError when the rebuilt bytes are not the
    new version's (their CRC32C differs from the target's), WireError for an inconsistent frame."""
    if header.encoding == Encoding.SAME:
        if base is None or base.crc32c != header.target_crc32c or header.nbytes:
            raise WireError(f"array {name!r}: an unchanged block that the base does not hold")
        return
    if header.encoding == Encoding.WHOLE:
        if header.nbytes != region.size:
            raise WireError(
                f"array {name!r}: a whole block of {header.nbytes} bytes for {region.size}"
            )
        region[:] = payload
        got = header.crc32c  # the payload's, checked on arrival: now the region's bytes
    elif header.encoding == Encoding.SPARSE:
        if base is None:
            raise WireError(f"array {name!r}: a sparse block where the base has no block")
        apply_sparse(region, payload, itemsize)
        got = crc32c(region)
    else:
        raise WireError(f"array {name!r}: unknown delta encoding {header.encoding}")
    if got != header.target_crc32c:
        raise ChecksumError(
            f"array {name!r}: the block rebuilt from the delta fails its CRC32C (computed "
            f"{got:#010x}, expected {header.target_crc32c:#010x})"
        )


def apply_delta(
    manifest: Manifest,
    blocks: Iterable[tuple[DeltaHeader, np.ndarray]],
    buffers: dict[str, np.ndarray],
    base_headers: dict[tuple, BlockHeader],
) -> list[BlockHeader]:
    """Rebuilds the new version in ``buffers`` (the base's host arrays, by name; ``base_headers``
    its block headers by (array, start, stop)) from a delta's blocks, each payload already past
    its CRC32C; returns the new version's block headers, for its digest. On an error the
    buffers hold a mix of both versions."""
    headers = []
    for header, payload in blocks:
        spec = manifest.arrays[header.array]
        dest = buffers[spec.name][header.region + (Ellipsis,)]
        contiguous = dest.flags.c_contiguous
        region = (dest if contiguous else np.ascontiguousarray(dest)).reshape(-1).view(np.uint8)
        base = base_headers.get((header.array, header.start, header.stop))
        apply_block(header, payload, region, base, spec.itemsize, spec.name)
        if not contiguous:  # rebuilt in a copy of the region: put back
            np.copyto(dest, region.view(dest.dtype).reshape(dest.shape))
        headers.append(header.target())
    return headers
