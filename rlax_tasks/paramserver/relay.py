"""A replica's relay: every version its upstream commits, pulled, checked and committed here.

A replica (docs/design.md §16) takes no pushes from the trainer: a thread long-polls its first
live upstream as a registered worker (its ``replica_id``), reads each new version's wire stream
straight into this server's store through the push path (every block's CRC32C checked, the
version visible only once complete, the same digest as upstream's), then acks it there. So an
upstream collects a version only once every live replica has confirmed a newer one, by the rule
it already applies to workers (docs/design.md §6). An upstream that is down, or that sends a
corrupted version, is skipped for the next one in the list."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import urllib.parse
from typing import Any

from rlax_tasks.paramserver.errors import (
    ParameterServerError,
    VersionConflictError,
)
from rlax_tasks.paramserver.protocol import RELAY_HEADER, VERSION_HEADER
from rlax_tasks.paramserver.push_receiver import PushReceiver
from rlax_tasks.paramserver.store import VersionStore
from rlax_tasks.paramserver.transport import Transport
from rlax_tasks.paramserver.wire import ChecksumError, WireError
from rlax_tasks.services.http import MAX_WAIT_S, TRANSPORT_ERRORS, backoff_s

log = logging.getLogger(__name__)

POLL_S = min(10.0, MAX_WAIT_S)  # one long poll at the upstream (also its heartbeat)


class Relay:
    """Follows ``upstreams`` (first live one first) into ``receiver``'s store."""

    def __init__(
        self,
        upstreams: tuple[str, ...],
        replica_id: str,
        token: str,
        store: VersionStore,
        receiver: PushReceiver,
        timeout_s: float = 30.0,
    ) -> None:
        if not upstreams:
            raise ValueError("a relay needs at least one upstream URL")
        self.replica_id = replica_id
        self.store, self.receiver = store, receiver
        self._transports = [Transport(u, token, replica_id, timeout_s, 0) for u in upstreams]
        self._index = 0  # the upstream in use
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: Any = None  # the long poll under way (closed by ``stop``)
        self.relayed = 0  # versions committed here
        self.skipped: dict[str, int] = {}  # upstream URL -> times it was skipped (down, corrupt)
        self.last_error = ""

    @property
    def upstream(self) -> str:
        """The URL of the upstream in use."""
        return self._transports[self._index].url

    def start(self) -> Relay:
        self._thread = threading.Thread(target=self._loop, name="ps-relay", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops following and deregisters at the upstream (best effort), so its versions need
        no confirmation from this replica any more."""
        self._stop.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:  # ends the long poll under way
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=POLL_S + 5)
        with contextlib.suppress(ParameterServerError, *TRANSPORT_ERRORS):
            self._transports[self._index].call("DELETE", f"/v1/workers/{self.replica_id}")

    def status(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "upstreams": [t.url for t in self._transports],
            "upstream": self.upstream,
            "relayed": self.relayed,
            "skipped": dict(self.skipped),
            "last_error": self.last_error,
        }

    def _loop(self) -> None:
        failures = 0
        while not self._stop.is_set():
            transport = self._transports[self._index]
            try:
                got = self._relay_once(transport)
                failures = 0
                if got is not None:
                    self._ack(transport, got)
            except (ChecksumError, WireError) as e:
                self._skip(transport, f"sent a corrupted version: {e}")
            except (*TRANSPORT_ERRORS, ParameterServerError) as e:
                if self._stop.is_set():
                    return
                failures += 1
                self._skip(transport, f"unreachable: {e!r}")
                if failures >= len(self._transports):  # every upstream failed in a row
                    self._stop.wait(backoff_s(failures // len(self._transports), 0.2, 2.0))

    def _skip(self, transport: Transport, why: str) -> None:
        """Moves on to the next upstream (a single one is tried again after a back-off)."""
        self.last_error = f"{transport.url} {why}"
        self.skipped[transport.url] = self.skipped.get(transport.url, 0) + 1
        level = logging.WARNING if self.skipped[transport.url] <= 3 else logging.DEBUG
        log.log(level, "replica %s: upstream %s", self.replica_id, self.last_error)
        self._index = (self._index + 1) % len(self._transports)

    def _relay_once(self, transport: Transport) -> int | None:
        """One long poll for a version newer than ours; the version committed here, or None."""
        have = self.store.latest_version()
        query = {"wait_s": f"{POLL_S:.3f}"}
        if have is not None:
            query["min_version"] = str(have + 1)
        conn = self._conn = transport.connection(transport.timeout_s + POLL_S)
        if self._stop.is_set():
            return None
        try:
            target = "/v1/pull?" + urllib.parse.urlencode(query)
            conn.request("GET", target, headers={**transport.headers(), RELAY_HEADER: "1"})
            resp = conn.getresponse()
            if resp.status == 204:
                resp.read()
                return None
            if resp.status != 200:
                transport.raise_for_status(resp.status, resp.read(), "GET /v1/pull")
            conn.sock.settimeout(transport.timeout_s)
            version = int(resp.getheader(VERSION_HEADER, "-1"))
            length = int(resp.getheader("Content-Length", "-1"))
            if version < 0 or length < 0:
                raise WireError("a pull answer without its version or Content-Length")
            t0 = time.perf_counter()
            try:
                self.receiver.receive_push(version, resp, length)
            except VersionConflictError:  # committed here meanwhile (a restart's mirror)
                return None
            self.relayed += 1
            log.info(
                "replica %s: version %d relayed from %s in %.2fs",
                self.replica_id, version, transport.url, time.perf_counter() - t0,
            )  # fmt: skip
            return version
        finally:
            self._conn = None
            conn.close()

    def _ack(self, transport: Transport, version: int) -> None:
        """Confirms ``version`` at the upstream: it may collect anything older now."""
        transport.call("POST", f"/v1/workers/{self.replica_id}/ack", {"version": version})
