"""The wire format: block splitting, frames and their validation."""

import io
import json
import struct

import numpy as np
import pytest

from rlax_tasks.paramserver import wire


@pytest.mark.parametrize(
    "shape,max_bytes",
    [((), 64), ((7,), 8), ((5, 3), 24), ((4, 6, 5), 40), ((3, 2, 9), 4), ((2, 3, 4), 10**6)],
)
def test_blocks_tile_the_array_contiguously_and_bounded(shape, max_bytes):
    itemsize = 4
    a = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    flat = []
    for start, stop in wire.split_blocks(shape, itemsize, max_bytes):
        block = a[tuple(slice(s, e) for s, e in zip(start, stop, strict=True)) + (Ellipsis,)]
        assert block.nbytes <= max(max_bytes, itemsize)
        assert block.flags.c_contiguous
        flat.extend(block.reshape(-1).tolist())
    # blocks come in memory order and cover every element exactly once
    assert flat == a.reshape(-1).tolist()


def test_empty_arrays_have_no_blocks_and_tiny_chunks_are_rejected():
    assert list(wire.split_blocks((3, 0), 4, 64)) == []
    with pytest.raises(ValueError, match="smaller than one element"):
        list(wire.split_blocks((3,), 8, 4))


def test_bfloat16_resolves_and_unknown_dtype_is_a_wire_error():
    assert wire.resolve_dtype("bfloat16").itemsize == 2
    with pytest.raises(wire.WireError, match="unknown dtype"):
        wire.resolve_dtype("float7")


def _stream(blocks_payload, manifest, headers=None, digest=None):
    out = io.BytesIO()
    out.write(manifest.encode())
    for header, payload in blocks_payload:
        out.write(header.encode())
        out.write(payload)
    headers = [h for h, _ in blocks_payload] if headers is None else headers
    out.write(wire.end_frame(len(headers), digest or wire.version_digest(manifest, headers)))
    out.seek(0)
    return out


def test_frames_round_trip_and_validation():
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    man = wire.Manifest(3, (wire.ArraySpec("w", "float32", (3, 4)),), 1)
    payload = bytes(wire.as_bytes(data))
    h = wire.BlockHeader(0, (0, 0), (3, 4), len(payload), wire.crc32c(payload))
    assert len(h.encode()) == wire.block_header_size(2) == 24 + 32
    stream = _stream([(h, payload)], man)
    got = wire.read_manifest(stream)
    assert got == man and got.format == wire.FORMAT == 2
    hdr = wire.read_block_header(stream, got)
    assert hdr == h
    assert stream.read(hdr.nbytes) == payload
    assert wire.check_crc32c(payload, hdr.crc32c)
    wire.read_end(stream, got, [hdr])

    bad_region = wire.BlockHeader(0, (0, 0), (4, 4), 64, h.crc32c)
    stream = _stream([(bad_region, b"\0" * 64)], man)
    wire.read_manifest(stream)
    with pytest.raises(wire.WireError, match="outside"):
        wire.read_block_header(stream, man)

    wrong_size = wire.BlockHeader(0, (0, 0), (1, 4), 99, h.crc32c)
    stream = _stream([(wrong_size, b"\0" * 99)], man)
    wire.read_manifest(stream)
    with pytest.raises(wire.WireError, match="declares 99 bytes"):
        wire.read_block_header(stream, man)

    with pytest.raises(wire.WireError, match="digest"):
        stream = io.BytesIO(wire.end_frame(1, b"\0" * 32))
        wire.read_end(stream, man, [h])
    with pytest.raises(wire.WireError, match="manifest"):
        wire.read_manifest(io.BytesIO(b"XXXX" + b"\0" * 8))


def test_crc32c_is_the_castagnoli_checksum_of_any_buffer():
    # the standard check value of CRC-32C ("123456789"), from bytes, memoryviews and numpy
    assert wire.crc32c(b"123456789") == 0xE3069283
    raw = np.frombuffer(b"123456789", np.uint8).copy()
    assert (
        wire.crc32c(memoryview(raw))
        == wire.crc32c(raw)
        == wire.crc32c(bytearray(raw))
        == 0xE3069283
    )
    floats = np.arange(1000, dtype=np.float32)
    assert wire.crc32c(wire.as_bytes(floats)) == wire.crc32c(floats.tobytes())
    assert not wire.check_crc32c(b"123456788", 0xE3069283)


def test_the_digest_covers_headers_and_manifest_not_only_the_checksums():
    """A region or CRC field damaged in transit, or a manifest changed, fails the end frame even
    though every block's payload still matches a CRC32C."""
    man = wire.Manifest(1, (wire.ArraySpec("w", "float32", (4, 4)),), 2)
    a, b = np.ones((2, 4), np.float32), np.zeros((2, 4), np.float32)
    h0 = wire.BlockHeader(0, (0, 0), (2, 4), 32, wire.crc32c(wire.as_bytes(a)))
    h1 = wire.BlockHeader(0, (2, 0), (4, 4), 32, wire.crc32c(wire.as_bytes(b)))
    digest = wire.version_digest(man, [h0, h1])
    moved = wire.BlockHeader(0, (0, 0), (2, 4), 32, h1.crc32c)  # same crc, another region
    assert wire.version_digest(man, [h0, moved]) != digest
    assert wire.version_digest(man, [h1, h0]) != digest  # order matters
    renamed = wire.Manifest(1, (wire.ArraySpec("v", "float32", (4, 4)),), 2)
    assert wire.version_digest(renamed, [h0, h1]) != digest
    # num_blocks is not part of it (a part's manifest has its own, the version's the total),
    # nor the version number: the same content has the same fingerprint in any version
    assert wire.version_digest(wire.Manifest(9, man.arrays, 7), [h0, h1]) == digest
    stream = _stream(
        [(h0, bytes(wire.as_bytes(a))), (moved, bytes(wire.as_bytes(b)))], man, digest=digest
    )
    got = wire.read_manifest(stream)
    headers = []
    for _ in range(2):
        headers.append(wire.read_block_header(stream, got))
        stream.read(32)
    with pytest.raises(wire.WireError, match="does not match the manifest and block headers"):
        wire.read_end(stream, got, headers)


def test_format_1_is_refused_on_the_wire_and_read_only_where_asked():
    man = wire.Manifest(1, (wire.ArraySpec("w", "float32", (4,)),), 0)
    old = json.dumps({**man.to_json(), "format": 1}).encode()
    frame = struct.pack("!4sQ", b"RXM1", len(old)) + old
    with pytest.raises(wire.WireError, match="unsupported wire format 1"):
        wire.read_manifest(io.BytesIO(frame))
    got = wire.read_manifest(io.BytesIO(frame), (wire.FORMAT, 1))
    assert got.format == 1 and got.arrays == man.arrays
    with pytest.raises(wire.WireError, match="read_block_header_v1"):
        wire.read_block_header(io.BytesIO(b""), got)
