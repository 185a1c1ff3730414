"""``keep_bytes`` over HTTP: pushes wait for acks instead of exceeding it (docs/design.md §6)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest

from rlax_tasks.cli import build_parser
from rlax_tasks.paramserver import ParameterServerError
from rlax_tasks.paramserver.errors import PushTimeoutError
from rlax_tasks.paramserver.wire import ArraySpec, Manifest
from rlax_tasks.utils.byte_sizes import parse_bytes
from tests.compute.helpers import wait_for
from tests.paramserver.helpers import TOKEN, start_server_process

UNIT = 64 * 256 * 4  # bytes of one version below


def _params(version: int) -> dict[str, np.ndarray]:
    return {"w": np.full((64, 256), version, np.float32)}


class _Push(threading.Thread):
    """A trainer's push on its own thread (it may wait for room); the error, if any, kept."""

    def __init__(self, client, version: int) -> None:
        super().__init__(daemon=True)
        self.client, self.version, self.error = client, version, None
        self.start()

    def run(self) -> None:
        try:
            self.client.push(self.version, _params(self.version))
        except BaseException as e:  # noqa: BLE001 - the test reads it
            self.error = e


def _waiting(server) -> list[int]:
    return server.store.memory()["waiting_for_room"]


def _open_push(address: str, version: int) -> socket.socket:
    """A PUT with no reservation that sends its headers and manifest, then no blocks (yet)."""
    url = urllib.parse.urlsplit(address)
    manifest = Manifest(version, (ArraySpec("w", "float32", (64, 256)),), 1).encode()
    sock = socket.create_connection((url.hostname, url.port), timeout=10)
    sock.sendall(
        f"PUT /v1/versions/{version} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(manifest) + UNIT}\r\n\r\n".encode()
        + manifest
    )
    return sock


def test_byte_limit_is_never_exceeded_across_pushes_and_status_reports_it(make_server, client_for):
    server = make_server(keep_versions=10, keep_bytes=3 * UNIT)
    trainer = client_for(server.address, push_wait_s=5.0)
    worker = client_for(server.address, worker_id="w")
    peak, stop = [0], threading.Event()

    def watch() -> None:  # samples consistent snapshots while pushes stream in
        while not stop.is_set():
            memory = server.store.memory()
            peak[0] = max(peak[0], memory["bytes_held"] + memory["bytes_in_flight"])

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        for v in range(1, 8):
            trainer.push(v, _params(v))
            version, _ = worker.pull(min_version=v)
            worker.ack(version)
        status = trainer.status()
        assert status["keep_bytes"] == 3 * UNIT
        assert status["versions"] == [5, 6, 7]  # keep_versions=10: only the byte limit deleted
        assert status["bytes_held"] == 3 * UNIT and status["bytes_in_flight"] == 0
        # two pushes at once: version 8 stalls mid-stream while version 9 goes through
        stalled = _open_push(server.address, 8)
        wait_for(lambda: trainer.status()["pushes"].get("8", {}).get("bytes") == UNIT)
        trainer.push(9, _params(9))
        assert trainer.status()["versions"] == [7, 9]  # 8 in flight counted: 6 made room too
        stalled.close()
        wait_for(lambda: trainer.status()["bytes_in_flight"] == 0)
    finally:
        stop.set()
        watcher.join()
    assert peak[0] == 3 * UNIT  # reached, never exceeded


def test_a_push_that_does_not_fit_waits_for_an_ack_then_completes(make_server, client_for, caplog):
    server = make_server(keep_versions=10, keep_bytes=2 * UNIT)
    trainer = client_for(server.address, push_wait_s=20.0)
    worker = client_for(server.address, worker_id="w0")
    trainer.push(1, _params(1))
    worker.ack(worker.pull()[0])
    trainer.push(2, _params(2))
    with caplog.at_level(logging.WARNING, "rlax_tasks.paramserver"):
        push = _Push(trainer, 3)  # w0 still runs version 1: versions 1 and 2 fill keep_bytes
        wait_for(lambda: _waiting(server) == [3], timeout_s=10, every_s=0.02)
        assert push.is_alive() and server.store.versions() == [1, 2]
        t0 = time.monotonic()
        worker.ack(2)  # version 1 is no longer needed
        push.join(timeout=10)
    assert not push.is_alive() and push.error is None
    assert time.monotonic() - t0 < 2.0  # as soon as it fits, not at the next poll
    assert server.store.versions() == [2, 3]
    assert server.store.memory()["bytes_held"] == 2 * UNIT
    waits = [r for r in caplog.records if "version 3 waits for room" in r.getMessage()]
    assert waits and waits[0].levelno == logging.WARNING
    text = waits[0].getMessage()
    assert f"needs {UNIT} bytes" in text and f"keep_bytes={2 * UNIT}" in text
    assert "1 (65536 bytes), 2 (65536 bytes, newest)" in text and "w0 (acked 1)" in text


def test_a_worker_timing_out_releases_a_waiting_push(make_server, client_for):
    server = make_server(keep_versions=10, keep_bytes=2 * UNIT, worker_timeout_s=0.5)
    trainer = client_for(server.address, push_wait_s=20.0)
    ghost = client_for(server.address, worker_id="ghost")
    trainer.push(1, _params(1))
    ghost.ack(ghost.pull()[0])
    trainer.push(2, _params(2))
    t0 = time.monotonic()
    trainer.push(3, _params(3))  # waits until the silent ghost is dropped, then goes
    assert 0.3 <= time.monotonic() - t0 < 3.0
    assert "ghost" not in server.store.workers()
    assert server.store.versions() == [2, 3]


def test_a_push_waits_at_most_push_wait_s_then_a_clear_timeout(make_server, client_for):
    server = make_server(keep_versions=10, keep_bytes=2 * UNIT)
    trainer = client_for(server.address, push_wait_s=0.5)
    worker = client_for(server.address, worker_id="w0")
    trainer.push(1, _params(1))
    worker.ack(1)
    trainer.push(2, _params(2))
    t0 = time.monotonic()
    with pytest.raises(PushTimeoutError, match=r"version 3.*push_wait_s=0.5s.*w0 \(acked 1\)"):
        trainer.push(3, _params(3))
    assert 0.4 < time.monotonic() - t0 < 5.0
    assert isinstance(PushTimeoutError("x"), TimeoutError)
    memory = server.store.memory()
    assert memory["bytes_in_flight"] == 0 and memory["waiting_for_room"] == []
    assert server.store.versions() == [1, 2]


def test_an_oversize_version_is_refused_at_once_naming_both_numbers(make_server, client_for):
    server = make_server(keep_bytes=UNIT - 1)
    trainer = client_for(server.address, push_wait_s=3.0)
    t0 = time.monotonic()
    with pytest.raises(ParameterServerError, match=rf"413.*{UNIT} bytes.*keep_bytes={UNIT - 1}"):
        trainer.push(1, _params(1))
    assert time.monotonic() - t0 < 5.0
    assert server.store.latest_version() is None
    assert server.store.memory()["bytes_in_flight"] == 0


def test_a_push_stream_without_room_gets_503_before_its_blocks_are_read(make_server, client_for):
    server = make_server(keep_versions=10, keep_bytes=2 * UNIT)
    trainer = client_for(server.address)
    worker = client_for(server.address, worker_id="w0")
    trainer.push(1, _params(1))
    worker.ack(1)
    trainer.push(2, _params(2))
    with _open_push(server.address, 3) as sock:  # the server answers before any block
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in reply
    assert b"version 3 waits for room" in reply and b"w0 (acked 1)" in reply
    assert server.store.versions() == [1, 2]
    assert server.store.memory()["bytes_in_flight"] == 0


@pytest.mark.parametrize(
    "text,size",
    [("1024", 1024), ("64GiB", 64 * 2**30), ("500MB", 500 * 10**6), ("1.5kib", 1536),
     ("2 TB", 2 * 10**12), ("7B", 7)],
)  # fmt: skip
def test_cli_parses_sizes(text, size):
    args = build_parser().parse_args(["ps", "serve", "--keep-bytes", text])
    assert args.keep_bytes == size == parse_bytes(text)
    assert build_parser().parse_args(["ps", "serve"]).keep_bytes is None


@pytest.mark.parametrize("text", ["64G", "lots", "-5", "0", "1e9", ""])
def test_cli_rejects_a_bad_size_with_a_clear_error(text, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["ps", "serve", "--keep-bytes", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("rlax ps serve: error: argument --keep-bytes:") and repr(text) in err


def test_ps_serve_keep_bytes_reaches_the_status(tmp_path):
    proc, url = start_server_process(str(tmp_path / "run"), "--keep-bytes", "1MiB")
    try:
        request = urllib.request.Request(
            f"{url}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            status = json.loads(resp.read())
        assert status["keep_bytes"] == 2**20 and status["bytes_held"] == 0
    finally:
        proc.kill()
        proc.wait()
