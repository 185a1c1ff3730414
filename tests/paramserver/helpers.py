"""Test helpers: a GCS emulator, a byte-corrupting TCP proxy, a parameter server subprocess."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

# below the ephemeral range, as `rlax run` draws its services' ports: a bind(0) port could be
# taken by one of the test's own outgoing connections before the server listens on it
from rlax_tasks.process.ports import free_port

TOKEN = "test-token"


@contextlib.contextmanager
def gcs_emulator(bucket: str = "rlax-test") -> Iterator[str]:
    """An in-process gcp-storage-emulator with ``bucket`` and GCS's generation preconditions
    (``tests.gcs_generations``); STORAGE_EMULATOR_HOST points at it."""
    from gcp_storage_emulator.server import create_server

    from rlax_tasks.rundir import storage
    from tests import gcs_generations

    gcs_generations.install()  # real GCS's generation preconditions, which the emulator lacks
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True, default_bucket=bucket)
    server.start()
    old = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = f"http://127.0.0.1:{port}"
    storage._client.cache_clear()
    try:
        yield f"gs://{bucket}"
    finally:
        server.stop()
        if old is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = old
        storage._client.cache_clear()


class CorruptingProxy:
    """Forwards TCP to ``upstream``; flips one byte at ``offset`` of the next ``count`` replies
    that are longer than ``offset`` bytes (only weight streams are that long) -- of the next
    ``count`` requests instead with ``requests=True`` (a push corrupted on its way in)."""

    def __init__(self, upstream_port: int, offset: int, count: int, requests: bool = False) -> None:
        self.upstream_port, self.offset, self.remaining = upstream_port, offset, count
        self.requests = requests
        self.corrupted = 0
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            for src, dst, corrupt in (
                (client, upstream, self.requests),
                (upstream, client, not self.requests),
            ):
                threading.Thread(target=self._pipe, args=(src, dst, corrupt), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, corrupt: bool) -> None:
        seen = 0
        try:
            while True:
                data = bytearray(src.recv(1 << 16))
                if not data:
                    break
                if corrupt and seen <= self.offset < seen + len(data):
                    with self._lock:
                        if self.remaining > 0:
                            self.remaining -= 1
                            self.corrupted += 1
                            data[self.offset - seen] ^= 0xFF
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


def start_server_process(run_root: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """`rlax ps serve` in a subprocess; returns (process, url read from its first stdout line)."""
    env = dict(os.environ, RLAX_PS_TOKEN=TOKEN)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlax_tasks.cli", "ps", "serve", "--port", "0",
         "--run-root", run_root, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )  # fmt: skip
    url = proc.stdout.readline().strip()
    if not url.startswith("http://127.0.0.1:"):
        proc.kill()
        raise RuntimeError(f"server did not start: {url!r} {proc.stderr.read()}")
    return proc, url
