"""Pulls on the server's host: versions copied out of the server's shared memory, still checked
block by block; segments recycled, never while read; TCP whenever shared memory is not usable."""

from __future__ import annotations

import http.client
import json
import logging
import signal
import urllib.parse

import ml_dtypes
import numpy as np
import pytest

from rlax_tasks.paramserver import CorruptedWeightsError, PullTimeoutError
from rlax_tasks.paramserver import shared_memory as shm
from rlax_tasks.paramserver.protocol import SHARED_MEMORY_TYPE
from rlax_tasks.paramserver.wire import WireError
from tests.paramserver.helpers import TOKEN, start_server_process

pytestmark = pytest.mark.skipif(not shm.available(), reason="needs memfd and /proc (Linux)")
CLIENT_LOG = "rlax_tasks.paramserver.client"


def _params(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {
        "embed": rng.standard_normal((96, 64)).astype(np.float32) + version,
        "scale": np.asarray(version, np.int32),  # a scalar
        "norm": rng.standard_normal(64).astype(ml_dtypes.bfloat16),
        "empty": np.zeros((0, 8), np.float32),
    }


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        np.testing.assert_array_equal(np.asarray(got[name]), value, err_msg=name)


def _descriptor(address: str, version: int) -> dict:
    """What the server answers a same-host pull of ``version``: where it lies."""
    url = urllib.parse.urlsplit(address)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    query = urllib.parse.urlencode({"local": shm.host_identity()})
    conn.request(
        "GET", f"/v1/versions/{version}?{query}", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    assert resp.status == 200 and resp.getheader("Content-Type") == SHARED_MEMORY_TYPE, body[:200]
    return json.loads(body)


def test_a_same_host_pull_copies_from_shared_memory_into_the_arrays_given(
    server, client_for, caplog
):
    trainer = client_for(server.address, chunk_bytes=4096)
    worker = client_for(server.address, worker_id="w0")
    trainer.push(1, _params(1))
    with caplog.at_level(logging.DEBUG, CLIENT_LOG):
        version, got = worker.pull()
    assert version == 1 and "through shared memory" in caplog.text
    _assert_equal(got, _params(1))

    trainer.push(2, _params(2))
    version, again = worker.pull(min_version=2, out=got)
    assert version == 2
    assert all(again[name] is got[name] for name in got)  # received in place: no new arrays
    _assert_equal(again, _params(2))

    bad = dict(got, embed=np.zeros((96, 65), np.float32))
    with pytest.raises(ValueError, match=r"out\['embed'\] is float32\[96, 65\].*float32\[96, 64\]"):
        worker.pull(out=bad)
    with pytest.raises(ValueError, match="without shardings= or like="):
        worker.pull(out=got, like=got)
    assert server.status()["bytes_spare"] == 0  # both versions are still held


def test_tcp_when_the_client_opts_out_or_cannot_open_the_segments(
    server, client_for, caplog, monkeypatch
):
    client_for(server.address).push(1, _params(1))
    with caplog.at_level(logging.DEBUG, CLIENT_LOG):
        _assert_equal(client_for(server.address, shared_memory=False).pull()[1], _params(1))
    assert "through TCP" in caplog.text and "through shared memory" not in caplog.text

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/proc/1/fd/7")

    monkeypatch.setattr(shm._Mapped, "__init__", refuse)
    caplog.clear()
    worker = client_for(server.address)
    with caplog.at_level(logging.DEBUG, CLIENT_LOG):
        _assert_equal(worker.pull()[1], _params(1))
        _assert_equal(worker.pull()[1], _params(1))
    assert caplog.text.count("unusable") == 1  # said once, then TCP without trying again
    assert caplog.text.count("through TCP") == 2


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "tcp"])
def test_a_byte_flipped_in_the_servers_memory_is_detected(make_server, client_for, shared_memory):
    """Both ways out of the server's memory check every block's CRC32C: a flipped byte in a
    held version is never handed to a worker."""
    server = make_server()
    client_for(server.address, chunk_bytes=4096).push(1, _params(1))
    block = server.store.get(1).blocks[3]
    assert block.segment is not None  # received into shared memory
    block.data[100] ^= 0x40
    worker = client_for(server.address, retries=1, shared_memory=shared_memory)
    with pytest.raises(CorruptedWeightsError, match="2 times.*block 3 of array 'embed' fails"):
        worker.pull()


def _collect_version_1(server, client_for) -> tuple:
    """A server keeping one version, a worker that pulled and acked 1 and 2: version 1 is
    collected and its segment free. Returns (trainer, worker)."""
    trainer = client_for(server.address)
    worker = client_for(server.address, worker_id="w0")
    worker.register()
    worker.ack(worker.pull()[0])
    trainer.push(2, _params(2))
    worker.ack(worker.pull()[0])
    assert server.store.versions() == [2]
    return trainer, worker


def test_segments_are_recycled_and_a_stale_descriptor_is_refused(make_server, client_for):
    server = make_server(keep_versions=1)
    client_for(server.address).push(1, _params(1))
    stale = _descriptor(server.address, 1)
    trainer, worker = _collect_version_1(server, client_for)
    assert server.status()["bytes_spare"] >= _params(1)["embed"].nbytes  # kept for reuse
    trainer.push(3, _params(3))  # takes version 1's segment
    assert server.status()["bytes_spare"] == 0
    assert server.store.get(3).segments()[0].inode == stale["segments"][0]["inode"]

    reader = shm.SegmentReader()
    with pytest.raises(shm.SegmentGoneError, match="no longer holds version 1"):
        with reader.reading(stale["segments"]):
            pass
    elsewhere = [dict(stale["segments"][0], path="/etc/passwd")]
    with pytest.raises(WireError, match="not a /proc/<pid>/fd/<n> segment"):
        with reader.reading(elsewhere):
            pass
    reader.close()
    _assert_equal(worker.pull()[1], _params(3))


def test_a_segment_being_read_is_not_recycled(make_server, client_for):
    server = make_server(keep_versions=1)
    client_for(server.address).push(1, _params(1))
    first = _descriptor(server.address, 1)
    reader = shm.SegmentReader()
    with reader.reading(first["segments"]) as copy:  # a slow reader holds version 1
        trainer, _ = _collect_version_1(server, client_for)
        trainer.push(3, _params(3))  # version 1's segment is free but read: a new one
        assert server.store.get(3).segments()[0].inode != first["segments"][0]["inode"]
        raw, segment, offset = first["blocks"][0]
        nbytes = int.from_bytes(bytes.fromhex(raw)[12:20], "big")
        dest = np.empty(nbytes, np.uint8)
        copy(segment, offset, memoryview(dest))
        np.testing.assert_array_equal(dest.view(np.float32), _params(1)["embed"].reshape(-1))
    reader.close()


def test_workers_in_other_processes_read_the_servers_memory(tmp_path, client_for, caplog):
    """The real layout: `rlax ps serve` in its own process, this process a worker on its host."""
    proc, url = start_server_process(str(tmp_path / "run"), "--keep-versions", "1")
    try:
        trainer = client_for(url)
        worker = client_for(url, worker_id="w0")
        worker.register()
        held = None
        for v in (1, 2, 3):
            trainer.push(v, _params(v))
            with caplog.at_level(logging.DEBUG, CLIENT_LOG):
                version, held = worker.pull(min_version=v, out=held)
            assert version == v
            _assert_equal(held, _params(v))
            worker.ack(v)
        assert caplog.text.count("through shared memory") == 3
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def test_a_version_that_keeps_leaving_memory_still_ends_at_the_deadline(
    server, client_for, monkeypatch
):
    client_for(server.address).push(1, _params(1))

    def gone(self, seg):
        raise shm.SegmentGoneError(f"segment {seg['path']} no longer holds version 1")

    monkeypatch.setattr(shm._Mapped, "check_stamp", gone)
    with pytest.raises(PullTimeoutError, match="no version >= 1"):
        client_for(server.address).pull(min_version=1, timeout_s=0.5)
