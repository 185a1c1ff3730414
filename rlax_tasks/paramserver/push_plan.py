"""What a push sends: each array's spec and its blocks, read from the shards where they live.

A sharded ``jax.Array`` goes out one addressable shard at a time (replicas once), never gathered
on one device. On a multi-host trainer each host sends one part of the version: the blocks of
its shards whose replica_id is 0, and host-local leaves from process 0 only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from rlax_tasks.paramserver.wire import ArraySpec, as_bytes, resolve_dtype, split_blocks


class PlannedBlock(NamedTuple):
    """One block to send: its place in the global array and how to get its bytes."""

    array: int
    start: tuple
    stop: tuple
    nbytes: int
    fetch: Callable[[], memoryview]


def push_part(leaves: Any) -> tuple[int, int] | None:
    """(this process's index, process count) when some leaf is a jax.Array spanning hosts: the
    push is then one part of a multi-host version; None for a whole version."""
    if any(isinstance(leaf, jax.Array) and not leaf.is_fully_addressable for leaf in leaves):
        return jax.process_index(), jax.process_count()
    return None


def plan_leaf(
    index: int, name: str, leaf: Any, chunk_bytes: int, part: tuple[int, int] | None = None
) -> tuple[ArraySpec, list[PlannedBlock]]:
    """The spec of one array and its blocks: per unique addressable shard for a jax.Array.

    In a part of a multi-host push (``part``), a global array contributes the blocks of this
    host's shards with replica_id 0 (exactly one host holds each region's replica 0), and a
    host-local leaf (numpy, or a fully addressable jax.Array) is sent by part 0 only."""
    if isinstance(leaf, jax.Array):
        shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
        local = leaf.is_fully_addressable
        shards = []
        for shard in leaf.addressable_shards:
            if shard.replica_id != 0:
                continue
            offset = tuple(
                s.indices(d)[0] if isinstance(s, slice) else int(s)
                for s, d in zip(shard.index, shape, strict=True)
            )
            shards.append((offset, shard.data))
    else:
        host = np.asarray(leaf)
        shape, dtype, local = tuple(host.shape), host.dtype, True
        shards = [((0,) * host.ndim, host)]
    if part is not None and local and part[0] != 0:
        shards = []  # the same on every host: part 0 sends it
    spec = ArraySpec(name, dtype.name if dtype.name != "void" else str(dtype), shape)
    if resolve_dtype(spec.dtype) != dtype:
        raise ValueError(f"array {name!r} has dtype {dtype} that cannot travel by name")
    blocks = []
    for offset, data in shards:
        local_shape = tuple(data.shape)
        source = _host_source(data)
        for start, stop in split_blocks(local_shape, dtype.itemsize, chunk_bytes):
            region = tuple(slice(a, b) for a, b in zip(start, stop, strict=True))
            nbytes = (
                int(np.prod([b - a for a, b in zip(start, stop, strict=True)])) * dtype.itemsize
            )
            blocks.append(
                PlannedBlock(
                    index,
                    tuple(o + a for o, a in zip(offset, start, strict=True)),
                    tuple(o + b for o, b in zip(offset, stop, strict=True)),
                    nbytes,
                    _fetcher(source, region),
                )
            )
    return spec, blocks


def _host_source(data: Any) -> Any:
    """A numpy view of a host-resident shard (zero-copy on CPU); the device array otherwise."""
    if isinstance(data, np.ndarray):
        return data
    if all(d.platform == "cpu" for d in data.devices()):
        return np.asarray(data)
    return data  # accelerator memory: each block is copied to the host when it is sent


def _fetcher(source: Any, region: tuple[slice, ...]) -> Any:
    def fetch() -> memoryview:
        return as_bytes(np.asarray(source[region + (Ellipsis,)]))

    return fetch
