"""The wire format: block splitting, frames and their validation."""

import io

import numpy as np
import pytest

from rlax_tasks.paramserver.wire import (
    ArraySpec,
    BlockHeader,
    Manifest,
    WireError,
    as_bytes,
    end_frame,
    read_block_header,
    read_end,
    read_manifest,
    resolve_dtype,
    split_blocks,
    version_digest,
)


@pytest.mark.parametrize(
    "shape,max_bytes",
    [((), 64), ((7,), 8), ((5, 3), 24), ((4, 6, 5), 40), ((3, 2, 9), 4), ((2, 3, 4), 10**6)],
)
def test_blocks_tile_the_array_contiguously_and_bounded(shape, max_bytes):
    itemsize = 4
    a = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    flat = []
    for start, stop in split_blocks(shape, itemsize, max_bytes):
        block = a[tuple(slice(s, e) for s, e in zip(start, stop, strict=True)) + (Ellipsis,)]
        assert block.nbytes <= max(max_bytes, itemsize)
        assert block.flags.c_contiguous
        flat.extend(block.reshape(-1).tolist())
    # blocks come in memory order and cover every element exactly once
    assert flat == a.reshape(-1).tolist()


def test_empty_arrays_have_no_blocks_and_tiny_chunks_are_rejected():
    assert list(split_blocks((3, 0), 4, 64)) == []
    with pytest.raises(ValueError, match="smaller than one element"):
        list(split_blocks((3,), 8, 4))


def test_bfloat16_resolves_and_unknown_dtype_is_a_wire_error():
    assert resolve_dtype("bfloat16").itemsize == 2
    with pytest.raises(WireError, match="unknown dtype"):
        resolve_dtype("float7")


def _stream(blocks_payload, manifest, hashes):
    out = io.BytesIO()
    out.write(manifest.encode())
    for header, payload in blocks_payload:
        out.write(header.encode())
        out.write(payload)
    out.write(end_frame(len(hashes), version_digest(hashes)))
    out.seek(0)
    return out


def test_frames_round_trip_and_validation():
    import hashlib

    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    man = Manifest(3, (ArraySpec("w", "float32", (3, 4)),), 1)
    payload = bytes(as_bytes(data))
    h = BlockHeader(0, (0, 0), (3, 4), len(payload), hashlib.sha256(payload).digest())
    stream = _stream([(h, payload)], man, [h.sha256])
    got = read_manifest(stream)
    assert got == man
    hdr = read_block_header(stream, got)
    assert hdr == h
    assert stream.read(hdr.nbytes) == payload
    read_end(stream, got, [hdr.sha256])

    bad_region = BlockHeader(0, (0, 0), (4, 4), 64, h.sha256)
    stream = _stream([(bad_region, b"\0" * 64)], man, [h.sha256])
    read_manifest(stream)
    with pytest.raises(WireError, match="outside"):
        read_block_header(stream, man)

    wrong_size = BlockHeader(0, (0, 0), (1, 4), 99, h.sha256)
    stream = _stream([(wrong_size, b"\0" * 99)], man, [h.sha256])
    read_manifest(stream)
    with pytest.raises(WireError, match="declares 99 bytes"):
        read_block_header(stream, man)

    with pytest.raises(WireError, match="digest"):
        stream = io.BytesIO(end_frame(1, b"\0" * 32))
        read_end(stream, man, [h.sha256])
    with pytest.raises(WireError, match="manifest"):
        read_manifest(io.BytesIO(b"XXXX" + b"\0" * 8))
