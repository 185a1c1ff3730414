"""The parameter server: a version store, its durable mirror and the HTTP server over them.

HTTP/1.1 on the standard library's threading server (gRPC would copy each message to protobuf;
docs/design.md §6 says why not FastAPI). ``push_receiver`` reads pushes, ``request_handler``
answers requests; `rlax ps serve` is ``paramserver.cli``."""

from __future__ import annotations

import http.server
import logging
import socket
import sys
import threading
from typing import Any

from rlax_tasks.paramserver import mirror as mirror_mod
from rlax_tasks.paramserver import shared_memory
from rlax_tasks.paramserver.egress import TokenBucket
from rlax_tasks.paramserver.push_receiver import PushReceiver
from rlax_tasks.paramserver.relay import Relay
from rlax_tasks.paramserver.request_handler import RequestHandler
from rlax_tasks.paramserver.server_config import ServerConfig
from rlax_tasks.paramserver.store import VersionStore
from rlax_tasks.paramserver.versions import WeightVersion
from rlax_tasks.services.endpoints import listen

# ServerConfig: importable from here, beside the server it configures
__all__ = ["ParameterServer", "ServerConfig"]

log = logging.getLogger(__name__)


class ParameterServer:
    """Holds versions in memory, serves them over HTTP, mirrors them to run_root/weights."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.segments = (
            shared_memory.SegmentPool()
            if config.shared_memory and shared_memory.available()
            else None
        )
        self.store = VersionStore(
            config.keep_versions,
            config.worker_timeout_s,
            keep_bytes=config.keep_bytes,
            assembly_timeout_s=config.assembly_timeout_s,
            segments=self.segments,
        )
        self.mirror = (
            mirror_mod.Mirror(config.run_root, config.mirror_every, config.mirror_keep)
            if config.run_root
            else None
        )
        self.receiver = PushReceiver(self.store, self.segments, config.verify_push, self._committed)
        # a replica relays its upstream's versions (docs/design.md §16); a link limit, if any
        self.relay = (
            Relay(config.upstreams, config.replica_id, config.token, self.store, self.receiver)
            if config.upstreams
            else None
        )
        self.egress = TokenBucket(config.egress_bytes_per_s) if config.egress_bytes_per_s else None
        self._httpd: http.server.ThreadingHTTPServer | None = None
        self._address: str | None = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ParameterServer:
        """Restores the newest committed mirror, then starts serving (non-blocking)."""
        if self.config.run_root:
            restored = mirror_mod.load_latest(self.config.run_root)
            if restored is not None:
                self.store.commit(restored)
                self.mirror.last_committed = restored.version
        handler = type(
            "Handler", (RequestHandler,), {"ps": self, "timeout": self.config.io_timeout_s}
        )
        sock, self._address = listen(self.config.host, self.config.port, _Server.request_queue_size)
        self._httpd = _Server(sock, handler)
        for target, name in ((self._httpd.serve_forever, "ps-http"), (self._reap, "ps-reaper")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        if self.relay is not None:
            self.relay.start()
            log.info(
                "parameter server replica %s (relaying %s) listening on %s",
                self.config.replica_id, ", ".join(self.config.upstreams), self.address,
            )  # fmt: skip
        else:
            log.info("parameter server listening on %s", self.address)
        return self

    @property
    def address(self) -> str:
        if self._address is None:
            raise RuntimeError("server not started")
        return self._address

    def stop(self) -> None:
        """Stops serving, finishes the pending mirror write, releases the port."""
        self._stop.set()
        if self.relay is not None:
            self.relay.stop()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self.mirror is not None:
            self.mirror.close()

    def __enter__(self) -> ParameterServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _reap(self) -> None:
        period = min(1.0, self.config.worker_timeout_s / 4)
        while not self._stop.wait(period):
            self.store.expire_workers()
            self.store.expire_assemblies()

    def status(self) -> dict[str, Any]:
        """What ``GET /v1/status`` answers: versions, workers, memory, assemblies, mirror."""
        latest = self.store.latest()
        return {
            "latest": None if latest is None else latest.version,
            "versions": self.store.versions(),
            "keep_versions": self.config.keep_versions,
            "workers": self.store.workers(),
            "bytes": None if latest is None else latest.manifest.nbytes,
            **self.store.memory(),  # keep_bytes, bytes_held, bytes_in_flight, pushes, waiting
            "shared_memory": self.segments is not None,  # same-host pulls read versions there
            "assembling": self.store.assemblies(),  # multi-host versions: parts received
            "replica": None if self.relay is None else self.relay.status(),
            "mirror": None
            if self.mirror is None
            else {"last_committed": self.mirror.last_committed, "errors": self.mirror.errors},
        }

    def _committed(self, weights: WeightVersion, seconds: float) -> None:
        """A version became visible: logged, and handed to the mirror."""
        log.info(
            "version %d committed: %d arrays, %.1f MB in %.2fs%s",
            weights.version,
            len(weights.manifest.arrays),
            weights.manifest.nbytes / 1e6,
            seconds,
            f" (last of {len(weights.part_digests)} parts)" if weights.part_digests else "",
        )
        if self.mirror is not None:
            self.mirror.submit(weights)


class _Server(http.server.ThreadingHTTPServer):
    """Serves on a socket already listening (``endpoints.listen``: the one bind every service
    shares, IPv6 too)."""

    daemon_threads = True
    allow_reuse_address = True
    # a fleet of workers pulling a new version at once (the kernel caps it at somaxconn)
    request_queue_size = 1024

    def __init__(self, sock: socket.socket, handler: type) -> None:
        super().__init__(sock.getsockname(), handler, bind_and_activate=False)
        self.socket.close()
        self.socket, self.server_address = sock, sock.getsockname()
        self.server_name, self.server_port = self.server_address[:2]

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-request (reset, timed out) is a debug line, not a
        traceback on stderr; anything else is reported as the standard library does."""
        if isinstance(sys.exc_info()[1], ConnectionResetError | BrokenPipeError | TimeoutError):
            log.debug("client %s went away: %s", client_address, sys.exc_info()[1])
            return
        super().handle_error(request, client_address)
