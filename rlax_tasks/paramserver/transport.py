"""How a ``ParameterServerClient`` reaches its server: connections, headers, retries and the
error each refusal becomes (docs/design.md §6, §13).

The small JSON calls go through one ``JsonClient``; pushes and pulls stream over their own
connections, with the same token, worker id and timeouts."""

from __future__ import annotations

import http.client
import json
import logging
import time
from typing import Any

from rlax_tasks.paramserver.errors import (
    AuthenticationError,
    ParameterServerError,
    PushAssemblyTimeoutError,
    ServerUnavailableError,
    VersionConflictError,
)
from rlax_tasks.paramserver.protocol import PART_HEADER, PARTS_HEADER, WORKER_HEADER
from rlax_tasks.services.endpoints import Endpoint
from rlax_tasks.services.http import TRANSPORT_ERRORS, JsonClient, Reply, backoff_s

log = logging.getLogger(__name__)

Part = tuple[int, int] | None  # (part, parts) of a multi-host push; None: a single-host one


class Transport:
    """One server's address (a URL, or the service file it publishes to), the run's token, this
    worker's id, the stall limit and the retries of every request."""

    def __init__(
        self, url: str, token: str, worker_id: str | None, timeout_s: float, retries: int
    ) -> None:
        self.endpoint = Endpoint(url)  # a service file is followed when the server moves
        self.worker_id, self.timeout_s, self.retries = worker_id, timeout_s, retries
        self.json = JsonClient(
            self.endpoint, token, timeout_s=timeout_s, retries=retries, backoff_s=0.1,
            max_backoff_s=1.0, refused=self.refusal, unreachable=self._unavailable,
        )  # fmt: skip

    @property
    def url(self) -> str:
        """The server's URL (or, before it published one, its service file)."""
        return str(self.endpoint)

    def headers(self, part: Part = None) -> dict[str, str]:
        """Every request's headers: the bearer token, and ``extra_headers``."""
        return self.json.headers(self.extra_headers(part))

    def extra_headers(self, part: Part = None) -> dict[str, str]:
        """This worker's id (a heartbeat with every call) and a multi-host push's part."""
        headers = {}
        if self.worker_id:
            headers[WORKER_HEADER] = self.worker_id
        if part is not None:
            headers[PART_HEADER], headers[PARTS_HEADER] = str(part[0]), str(part[1])
        return headers

    def connection(self, timeout_s: float) -> http.client.HTTPConnection:
        """A new connection for one streamed request (NotPublishedError: a ConnectionError)."""
        return self.json.connection(timeout_s)

    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        """One small JSON request, retried on transport errors; the decoded JSON reply."""
        return self.json.call(method, path, body, headers=self.extra_headers())

    def transfer_failed(self, error: Exception, attempt: int, what: str, last: bool) -> None:
        """After a push or pull broke off: ServerUnavailableError when it was the ``last``
        attempt, else a warning and the back-off after ``attempt`` before the next."""
        if last:
            raise ServerUnavailableError(f"{what} failed: {error!r}") from error
        log.warning("%s failed (%r); retrying", what, error)
        time.sleep(backoff_s(attempt, 0.2, 2.0))

    def refusal(self, reply: Reply, what: str) -> Exception:
        """The error for a refused request: its status's class, the server's reason."""
        text = f"{what} on {self.url}: HTTP {reply.status}: {error_message(reply.body)}"
        if reply.status in (401, 403):
            return AuthenticationError(text)
        if reply.status == 409:
            return VersionConflictError(text)
        if reply.status == 408:
            return PushAssemblyTimeoutError(text)
        return ParameterServerError(text)

    def raise_for_status(self, status: int, body: bytes, what: str) -> None:
        """The ``refusal`` of a reply with status >= 300; nothing for a success."""
        if status >= 300:
            raise self.refusal(Reply(status, body), what)

    def _unavailable(self, error: Exception, what: str) -> Exception:
        return ServerUnavailableError(f"{what} on {self.url} failed: {error!r}")


def early_reply(conn: http.client.HTTPConnection, timeout_s: float) -> tuple[int, bytes] | None:
    """(status, body) of a reply the server sent before it stopped reading the request (it
    refused the push early and closed), or None when there is none to read."""
    if conn.sock is None:
        return None
    try:
        conn.sock.settimeout(timeout_s)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (*TRANSPORT_ERRORS, http.client.HTTPException):
        return None


def error_message(body: bytes) -> str:
    """The ``error`` of a JSON error reply (or the start of any other body)."""
    try:
        return json.loads(body).get("error", "")
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")
