"""Durable mirror: kill -9 mid-push, restart from the mirror (local and GCS), `rlax ps serve`."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.parse

import numpy as np
import pytest

from rlax_tasks.evaluation.checkpoints import mirror_arrays
from rlax_tasks.paramserver import ParameterServer, ParameterServerClient, ServerConfig
from rlax_tasks.paramserver.mirror import (
    COMMIT,
    DATA,
    load_latest,
    mirrored_versions,
    read_version,
    version_dir,
)
from rlax_tasks.paramserver.wire import ArraySpec, ChecksumError, Manifest, as_bytes, crc32c
from rlax_tasks.rundir import storage
from tests.compute.helpers import wait_for
from tests.paramserver.helpers import TOKEN, gcs_emulator, start_server_process


def _params(version: int) -> dict[str, np.ndarray]:
    return {"a": np.full((128, 64), version, np.float32), "b": np.arange(7) * version}


def _wait_committed(run_root: str, version: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while version not in mirrored_versions(run_root)[0]:
        assert time.monotonic() < deadline, f"version {version} never committed to {run_root}"
        time.sleep(0.05)


def _partial_manifest(version: int) -> Manifest:
    """The manifest of the push ``_start_partial_push`` leaves unfinished."""
    return Manifest(version, (ArraySpec("a", "float32", (128, 64)),), 1)


def _start_partial_push(url: str, version: int) -> socket.socket:
    """Sends the headers, the manifest and a piece of the first block, then stops."""
    parts = urllib.parse.urlsplit(url)
    man = _partial_manifest(version).encode()
    sock = socket.create_connection((parts.hostname, parts.port))
    sock.sendall(
        f"PUT /v1/versions/{version} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(man) + _partial_manifest(version).nbytes}\r\n\r\n".encode()
        + man
        + b"RXB2\0\0"
    )
    return sock


@pytest.mark.slow
def test_server_killed_mid_push_restarts_from_the_mirror_without_the_partial_version(tmp_path):
    run_root = str(tmp_path / "run")
    proc, url = start_server_process(run_root, "--keep-versions", "2", "--mirror-every", "2")
    try:
        c = ParameterServerClient(url, token=TOKEN, timeout_s=10)
        for v in (1, 2, 3):
            c.push(v, _params(v))
        _wait_committed(run_root, 2)
        assert mirrored_versions(run_root) == ([2], [])  # every 2nd version only
        sock = _start_partial_push(url, 4)
        # the kill lands mid-push: the server has read version 4's manifest and sized its room
        receiving = {"bytes": _partial_manifest(4).nbytes, "receiving": True}
        wait_for(lambda: c.status()["pushes"].get("4") == receiving)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        sock.close()
    finally:
        if proc.poll() is None:
            proc.kill()
    # a crash mid-mirror leaves a version directory without its COMMIT marker
    os.makedirs(version_dir(run_root, 6))
    with open(os.path.join(version_dir(run_root, 6), DATA), "wb") as fh:
        fh.write(b"partial")

    proc, url = start_server_process(run_root, "--keep-versions", "2")
    try:
        c = ParameterServerClient(url, token=TOKEN, timeout_s=10)
        assert c.latest_version() == 2  # neither the half-pushed 4 nor the uncommitted 6
        assert c.status()["versions"] == [2]
        version, arrays = c.pull()
        assert version == 2
        np.testing.assert_array_equal(arrays["a"], _params(2)["a"])
        np.testing.assert_array_equal(arrays["b"], _params(2)["b"])
        assert not os.path.exists(version_dir(run_root, 6))  # removed at start
        c.push(3, _params(3))  # the trainer continues after the restored version
        assert c.pull()[0] == 3
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0


def test_restart_skips_a_damaged_mirror_and_prunes_old_ones(tmp_path):
    run_root = str(tmp_path / "run")
    config = ServerConfig(token=TOKEN, run_root=run_root, mirror_every=1, mirror_keep=2)
    with ParameterServer(config) as server:
        c = ParameterServerClient(server.address, token=TOKEN)
        for v in (1, 2, 3):
            c.push(v, _params(v))
            assert server.mirror.wait_idle(20)
    assert mirrored_versions(run_root) == ([2, 3], [])  # mirror_keep=2
    # flip one byte of version 3's data: its sha256 no longer matches
    data_path = os.path.join(version_dir(run_root, 3), DATA)
    raw = bytearray(open(data_path, "rb").read())
    raw[-100] ^= 0xFF
    open(data_path, "wb").write(bytes(raw))
    with ParameterServer(config) as server:
        assert server.store.latest_version() == 2


@pytest.mark.slow
def test_gcs_mirror_with_the_real_client_against_the_emulator(tmp_path):
    with gcs_emulator("ps-bucket") as bucket:
        run_root = storage.join(bucket, "runs", "r1")
        config = ServerConfig(token=TOKEN, run_root=run_root, mirror_every=1, mirror_keep=1)
        with ParameterServer(config) as server:
            c = ParameterServerClient(server.address, token=TOKEN)
            c.push(1, _params(1))
            big = {"a": np.random.default_rng(1).standard_normal((1024, 1024)).astype(np.float32)}
            c.push(2, big)  # 4 MiB: a multi-chunk resumable upload
            assert server.mirror.wait_idle(60)
            assert server.mirror.errors == 0
        assert mirrored_versions(run_root) == ([2], [])
        assert storage.exists(storage.join(version_dir(run_root, 2), COMMIT))
        with ParameterServer(config) as server:
            c = ParameterServerClient(server.address, token=TOKEN)
            version, arrays = c.pull()
            assert version == 2
            np.testing.assert_array_equal(arrays["a"], big["a"])


def test_ps_serve_without_a_token_is_a_one_line_error(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RLAX_PS_TOKEN"}
    out = subprocess.run(
        [sys.executable, "-m", "rlax_tasks.cli", "ps", "serve", "--run-root", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("rlax ps: error: RLAX_PS_TOKEN")
    assert "Traceback" not in out.stderr


# --------------------------------------------------------------------------- format-1 mirrors
def _write_format_1_mirror(run_root: str, version: int, arrays: dict, rows_per_block: int) -> None:
    """A mirror as written before wire format 2, built by hand: manifest "RXM1" with format 1,
    blocks "RXB1" carrying the sha256 of their bytes, end frame "RXE1" with sha256 over them."""
    blocks = []
    for index, array in enumerate(arrays.values()):
        for lo in range(0, array.shape[0], rows_per_block):
            hi = min(lo + rows_per_block, array.shape[0])
            rest = array.shape[1:]
            blocks.append(
                (index, (lo, *(0,) * len(rest)), (hi, *rest), bytes(as_bytes(array[lo:hi])))
            )
    manifest = json.dumps(
        {
            "format": 1,
            "version": version,
            "arrays": [
                {"name": n, "dtype": a.dtype.name, "shape": list(a.shape)}
                for n, a in arrays.items()
            ],
            "num_blocks": len(blocks),
        }
    ).encode()
    out = [struct.pack("!4sQ", b"RXM1", len(manifest)), manifest]
    hashes = []
    for index, start, stop, data in blocks:
        sha = hashlib.sha256(data).digest()
        hashes.append(sha)
        out.append(struct.pack("!4sIIQ32s", b"RXB1", index, len(start), len(data), sha))
        out.append(struct.pack(f"!{2 * len(start)}Q", *start, *stop))
        out.append(data)
    digest = hashlib.sha256(b"".join(hashes)).digest()
    out.append(struct.pack("!4sQ32s", b"RXE1", len(blocks), digest))
    prefix = version_dir(run_root, version)
    os.makedirs(prefix)
    with open(os.path.join(prefix, DATA), "wb") as fh:
        fh.write(b"".join(out))
    marker = {"version": version, "digest": digest.hex(), "parts": [], "time": time.time()}
    with open(os.path.join(prefix, COMMIT), "w") as fh:
        json.dump(marker, fh)


def test_a_mirror_written_in_wire_format_1_still_loads_and_is_served_in_format_2(tmp_path):
    run_root = str(tmp_path / "run")
    old = {
        "a": np.arange(128 * 64, dtype=np.float32).reshape(128, 64),
        "b": np.arange(7, dtype=np.int64) * 3,
    }
    _write_format_1_mirror(run_root, 4, old, rows_per_block=32)

    weights = read_version(run_root, 4)  # every sha256 checked, then re-checksummed
    assert weights.manifest.format == 2 and len(weights.blocks) == 5
    for block in weights.blocks:
        assert block.header.crc32c == crc32c(block.data)
    assert mirror_arrays(run_root)[0] == 4  # `rlax eval --weights-from` reads it too
    np.testing.assert_array_equal(mirror_arrays(run_root, 4)[1]["a"], old["a"])

    config = ServerConfig(token=TOKEN, run_root=run_root, mirror_every=1, mirror_keep=2)
    with ParameterServer(config) as server:
        c = ParameterServerClient(server.address, token=TOKEN)
        version, arrays = c.pull()  # served as a format-2 stream, verified by the client
        assert version == 4
        np.testing.assert_array_equal(arrays["a"], old["a"])
        np.testing.assert_array_equal(arrays["b"], old["b"])
        c.push(5, _params(5))
        assert server.mirror.wait_idle(20)
    assert read_version(run_root, 5).manifest.format == 2  # new mirrors: the current format

    # a damaged format-1 mirror is refused by its sha256, naming the block and its array
    damaged = str(tmp_path / "damaged")
    _write_format_1_mirror(damaged, 4, old, rows_per_block=32)
    _write_format_1_mirror(damaged, 6, {"a": old["a"] + 1}, rows_per_block=32)
    data_path = os.path.join(version_dir(damaged, 6), DATA)
    raw = bytearray(open(data_path, "rb").read())
    raw[-100] ^= 0xFF  # inside the last block's bytes
    open(data_path, "wb").write(bytes(raw))
    with pytest.raises(ChecksumError, match=r"block 3 \(array 'a'\) fails its sha256"):
        read_version(damaged, 6)
    assert load_latest(damaged).version == 4  # falls back to the older intact one
