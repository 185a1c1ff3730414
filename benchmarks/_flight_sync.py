"""The Arrow Flight side of benchmarks/weight_sync.py: a minimal Flight server, worker and push
with the parameter server's guarantees (CRC32C per block, a version digest, full coverage), for
comparison only (no product path)."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator

import numpy as np

from rlax_tasks.paramserver.wire import (
    ArraySpec,
    BlockHeader,
    ChecksumError,
    Manifest,
    WireError,
    as_bytes,
    check_coverage,
    crc32c,
    resolve_dtype,
    split_blocks,
    version_digest,
)


def _flight_schema() -> object:
    import pyarrow as pa

    return pa.schema(
        [
            ("array", pa.int32()),
            ("start", pa.list_(pa.int64())),
            ("stop", pa.list_(pa.int64())),
            ("crc32c", pa.uint32()),
            ("data", pa.binary()),
        ]
    )


def _flight_batch(header: BlockHeader, view: memoryview) -> object:
    """One block as a one-row record batch; its bytes are wrapped, not copied."""
    import pyarrow as pa

    offsets = pa.py_buffer(np.array([0, header.nbytes], np.int32))
    data = pa.Array.from_buffers(pa.binary(), 1, [None, offsets, pa.py_buffer(view)])
    return pa.RecordBatch.from_arrays(
        [
            pa.array([header.array], pa.int32()),
            pa.array([list(header.start)], pa.list_(pa.int64())),
            pa.array([list(header.stop)], pa.list_(pa.int64())),
            pa.array([header.crc32c], pa.uint32()),
            data,
        ],
        schema=_flight_schema(),
    )


def _flight_block(batch: object, manifest: Manifest, block_no: int) -> tuple[BlockHeader, object]:
    """(header, payload as a uint8 numpy view of the Arrow buffer) of one received block, its
    CRC32C checked (ChecksumError naming the block and its array)."""
    array = batch.column(0)[0].as_py()
    start = tuple(batch.column(1)[0].as_py())
    stop = tuple(batch.column(2)[0].as_py())
    expected = batch.column(3)[0].as_py()
    column = batch.column(4)
    _, offsets, data = column.buffers()
    lo, hi = np.frombuffer(offsets, np.int32, count=2, offset=4 * column.offset)
    payload = np.frombuffer(data, np.uint8, count=int(hi - lo), offset=int(lo))
    header = BlockHeader(array, start, stop, payload.nbytes, expected)
    if not 0 <= array < len(manifest.arrays):
        raise WireError(f"block {block_no} names array #{array} of {len(manifest.arrays)}")
    if crc32c(payload) != expected:
        name = manifest.arrays[array].name
        raise ChecksumError(f"block {block_no} of array {name!r} fails its CRC32C")
    return header, payload


def _flight_chunks(reader: object) -> Iterator[object]:
    """The chunks of a Flight stream, until it ends."""
    while True:
        try:
            yield reader.read_chunk()
        except StopIteration:
            return


def _check_version(manifest: Manifest, headers: list[BlockHeader], digest: bytes) -> None:
    """Raises ``WireError`` unless ``headers`` are all of the version, as its ``digest`` says."""
    if len(headers) != manifest.num_blocks:
        raise WireError(f"{len(headers)} blocks for {manifest.num_blocks}")
    if digest != version_digest(manifest, headers):
        raise WireError(f"version {manifest.version}: the digest does not match")
    check_coverage(manifest, headers)


def flight_server(ready: mp.Queue) -> None:
    """A Flight server holding the newest version (keep 1), every put verified like a push."""
    import pyarrow as pa
    import pyarrow.flight as fl

    class Server(fl.FlightServerBase):
        def __init__(self) -> None:
            super().__init__("grpc://127.0.0.1:0")
            self.cond = threading.Condition()
            self.version, self.table = -1, None

        def do_put(self, context, descriptor, reader, writer) -> None:  # noqa: ANN001
            manifest = Manifest.from_json(json.loads(descriptor.command))
            batches, headers, digest = [], [], b""
            for chunk in _flight_chunks(reader):
                header, _ = _flight_block(chunk.data, manifest, len(headers))
                headers.append(header)
                batches.append(chunk.data)
                if chunk.app_metadata is not None:
                    digest = chunk.app_metadata.to_pybytes()
            _check_version(manifest, headers, digest)
            meta = {"manifest": json.dumps(manifest.to_json()), "digest": digest.hex()}
            table = pa.Table.from_batches(batches, _flight_schema()).replace_schema_metadata(meta)
            with self.cond:
                self.version, self.table = manifest.version, table
                self.cond.notify_all()

        def do_get(self, context, ticket) -> object:  # noqa: ANN001
            want = int(ticket.ticket)
            with self.cond:
                if not self.cond.wait_for(lambda: self.version >= want, timeout=600):
                    raise fl.FlightTimedOutError(f"no version >= {want}")
                table = self.table
            return fl.RecordBatchStream(table)

    server = Server()
    ready.put(server.port)
    server.serve()


def flight_worker(port: int, worker_id: str, versions: int, results: mp.Queue) -> None:
    """``do_get`` of each new version into preallocated arrays, every block verified."""
    import pyarrow.flight as fl

    client = fl.connect(f"grpc://127.0.0.1:{port}")
    held = None
    for v in range(1, versions + 1):
        held = None
        reader = client.do_get(fl.Ticket(str(v).encode()))
        meta = reader.schema.metadata
        manifest = Manifest.from_json(json.loads(meta[b"manifest"]))
        held = {a.name: np.empty(a.shape, resolve_dtype(a.dtype)) for a in manifest.arrays}
        headers = []
        for chunk in _flight_chunks(reader):
            header, payload = _flight_block(chunk.data, manifest, len(headers))
            spec = manifest.arrays[header.array]
            dest = held[spec.name][header.region + (Ellipsis,)]
            np.copyto(dest, payload.view(dest.dtype).reshape(header.shape))
            headers.append(header)
        _check_version(manifest, headers, bytes.fromhex(meta[b"digest"].decode()))
        done = time.time()
        nbytes = sum(a.nbytes for a in held.values())
        results.put({"worker": worker_id, "version": manifest.version, "done": done,
                     "bytes": nbytes})  # fmt: skip
    del held


def flight_push(client: object, version: int, params: dict, chunk_bytes: int) -> None:
    """One version by ``do_put``: a batch per block, CRC32C computed over the trainer's bytes,
    the digest in the last batch's metadata; returns once the server verified and holds it."""
    import pyarrow as pa
    import pyarrow.flight as fl

    specs, blocks = [], []
    for index, (name, leaf) in enumerate(params.items()):
        host = np.asarray(leaf)
        specs.append(ArraySpec(name, host.dtype.name, tuple(host.shape)))
        for start, stop in split_blocks(host.shape, host.itemsize, chunk_bytes):
            region = tuple(slice(a, b) for a, b in zip(start, stop, strict=True))
            blocks.append((index, start, stop, as_bytes(host[region + (Ellipsis,)])))
    manifest = Manifest(version, tuple(specs), len(blocks))
    descriptor = fl.FlightDescriptor.for_command(json.dumps(manifest.to_json()))
    writer, _ = client.do_put(descriptor, _flight_schema())
    headers = []
    for i, (index, start, stop, view) in enumerate(blocks):
        header = BlockHeader(index, start, stop, len(view), crc32c(view))
        headers.append(header)
        batch = _flight_batch(header, view)
        if i == len(blocks) - 1:
            writer.write_with_metadata(batch, pa.py_buffer(version_digest(manifest, headers)))
        else:
            writer.write_batch(batch)
    writer.done_writing()
    writer.close()  # waits for the server's verdict
