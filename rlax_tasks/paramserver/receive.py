"""A pulled version's blocks into host arrays, each block's CRC32C checked as soon as it lands.

Each block is read straight into its place in the array (a staging buffer only for a region not
contiguous there); each array is handed to ``place`` once complete, so at most one host buffer
is held beside the placed arrays. ``out``: an earlier pull's host arrays, reused."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from rlax_tasks.paramserver.wire import (
    ArraySpec,
    BlockHeader,
    ChecksumError,
    Manifest,
    WireError,
    resolve_dtype,
)

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
