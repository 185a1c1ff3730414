"""HTTP plumbing every RLAX service shares: the bearer-token check (DESIGN §13), a FastAPI app
guarded by it and served on a socket from ``rlax_tasks.endpoints.listen``, and ``JsonClient``
(an ``Endpoint``, the token, a timeout per call, retries with exponential back-off).

    check_bearer(request_headers.get("Authorization"), token)  # AuthError: 401 / 403
    app = authorized_app("RLAX trainer", token)                # FastAPI, every route guarded
    client = JsonClient(url_or_service_file, token, timeout_s=10.0, retries=3)
    client.call("POST", "/v1/reset", {})                       # decoded JSON reply

Importable without JAX; FastAPI and uvicorn are imported only by the functions that build or
serve an app (the parameter server and the clients use neither).
"""

# no `from __future__ import annotations`: FastAPI reads bearer_dependency's annotation at runtime

import dataclasses
import hmac
import http.client
import json
import logging
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from rlax_tasks.endpoints import Endpoint

log = logging.getLogger(__name__)

BEARER = "Bearer "
MISSING_TOKEN = "missing bearer token"
WRONG_TOKEN = "wrong bearer token"
# what a request that never got a reply raises (refused, reset, timed out, cut short)
TRANSPORT_ERRORS = (OSError, http.client.HTTPException, EOFError)


# --------------------------------------------------------------------------- auth
class AuthError(Exception):
    """A request without the service's bearer token: 401 (none sent, with a ``WWW-Authenticate``
    challenge in ``headers``) or 403 (a wrong one)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def check_bearer(authorization: str | None, token: str | None, realm: str | None = None) -> None:
    """Raises AuthError unless ``authorization`` is ``Bearer <token>`` (compared in constant time);
    a service without a token (None or "") lets every request in."""
    if not token:
        return
    if not authorization or not authorization.startswith(BEARER):
        challenge = "Bearer" if realm is None else f'Bearer realm="{realm}"'
        raise AuthError(401, MISSING_TOKEN, {"WWW-Authenticate": challenge})
    given = authorization[len(BEARER) :].strip()
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise AuthError(403, WRONG_TOKEN)


def bearer_header(token: str | None) -> dict[str, str]:
    """The ``Authorization`` header a client sends with ``token`` (none without a token)."""
    return {"Authorization": f"{BEARER}{token}"} if token else {}


def bearer_dependency(token: str | None) -> Callable[..., None]:
    """A FastAPI dependency that answers ``check_bearer``'s 401 / 403 (no check without a token)."""
    from fastapi import HTTPException, Request

    def authorize(request: Request) -> None:
        try:
            check_bearer(request.headers.get("authorization"), token)
        except AuthError as e:
            raise HTTPException(e.status, e.message, e.headers or None) from None

    return authorize


def authorized_app(title: str, token: str | None, **kwargs: Any) -> Any:
    """A FastAPI application whose every route needs ``token`` as its bearer token."""
    from fastapi import Depends, FastAPI

    return FastAPI(title=title, dependencies=[Depends(bearer_dependency(token))], **kwargs)


def serve_app(app: Any, sock: socket.socket, log_level: str = "warning", **config: Any) -> None:
    """Serves an ASGI ``app`` with uvicorn on ``sock`` (from ``endpoints.listen``) until it is
    stopped (SIGINT / SIGTERM)."""
    import uvicorn

    uvicorn.Server(uvicorn.Config(app, log_level=log_level, **config)).run(sockets=[sock])


# --------------------------------------------------------------------------- client
def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait after failed attempt ``attempt`` (0-based): ``base_s`` doubled per
    attempt, at most ``cap_s``."""
    return min(base_s * 2**attempt, cap_s)


@dataclasses.dataclass(frozen=True)
class Reply:
    """A service's answer: its HTTP status and body."""

    status: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        """The decoded JSON body (None for an empty one)."""
        return json.loads(self.body) if self.body else None


class HttpStatusError(Exception):
    """A reply with an error status (what a ``JsonClient`` raises unless told otherwise)."""

    def __init__(self, reply: Reply, what: str) -> None:
        super().__init__(f"{what}: HTTP {reply.status}: {reply.text}")
        self.reply = reply


def _as_is(error: Exception, what: str) -> Exception:
    return error


class JsonClient:
    """JSON requests to one service: at its ``Endpoint`` (a URL, or the service file it publishes
    its URL to), with its bearer token and a timeout per call.

    A request that gets no reply (``TRANSPORT_ERRORS``; a service file with no address yet), or
    a reply whose status ``retry_status`` calls transient, is sent again after ``backoff_s``
    (doubling up to ``max_backoff_s``), up to ``retries`` more times (None: no limit) and until
    ``give_up_after_s`` (None: no limit); then ``unreachable(error, what)`` is raised (default:
    the error itself). ``call`` raises ``refused(reply, what)`` for a status >= 300 (default:
    ``HttpStatusError``). Thread-safe: each request opens its own connection.
    """

    def __init__(
        self,
        endpoint: Endpoint | str,
        token: str | None = None,
        *,
        timeout_s: float = 10.0,
        retries: int | None = 0,
        give_up_after_s: float | None = None,
        backoff_s: float = 0.1,
        max_backoff_s: float = 1.0,
        retry_status: Callable[[int], bool] | None = None,
        refused: Callable[[Reply, str], Exception] = HttpStatusError,
        unreachable: Callable[[Exception, str], Exception] = _as_is,
        retry_log_level: int = logging.DEBUG,
    ) -> None:
        self.endpoint = endpoint if isinstance(endpoint, Endpoint) else Endpoint(endpoint)
        self.token, self.timeout_s = token, timeout_s
        self.retries, self.give_up_after_s = retries, give_up_after_s
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.retry_status = retry_status
        self.refused, self.unreachable = refused, unreachable
        self.retry_log_level = retry_log_level

    @property
    def url(self) -> str:
        """The service's URL (or, before it published one, its service file)."""
        return str(self.endpoint)

    def headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The bearer header (with a token) and ``extra``."""
        return {**bearer_header(self.token), **(extra or {})}

    def connection(self, timeout_s: float | None = None) -> http.client.HTTPConnection:
        """A connection to the service's current address (NotPublishedError, a ConnectionError,
        while a published service has none); ``timeout_s`` bounds the connect and every read."""
        host, port = self.endpoint.host_port()
        return http.client.HTTPConnection(host, port, timeout=timeout_s or self.timeout_s)

    def call(self, method: str, path: str, body: Any = None, **options: Any) -> Any:
        """The decoded JSON reply of ``send(method, path, body, **options)``; raises
        ``refused(reply, what)`` for a status >= 300."""
        reply = self.send(method, path, body, **options)
        if reply.status >= 300:
            raise self.refused(reply, options.get("what") or f"{method} {path}")
        return reply.json()

    def send(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        timeout_s: float | None = None,
        headers: Mapping[str, str] | None = None,
        content_type: str | None = None,
        what: str | None = None,
    ) -> Reply:
        """One request, retried as the class says; its reply, whatever its status. ``body``:
        bytes (sent as ``content_type``, default octet-stream), or anything JSON encodes."""
        what = what or f"{method} {path}"
        if body is None or isinstance(body, bytes):
            data, kind = body, content_type or "application/octet-stream"
        else:
            data, kind = json.dumps(body).encode(), content_type or "application/json"
        all_headers = self.headers(headers)
        if data is not None:
            all_headers["Content-Type"] = kind
        deadline = None if self.give_up_after_s is None else time.monotonic() + self.give_up_after_s
        attempt = 0
        while True:
            try:
                reply = self._send_once(method, path, data, all_headers, timeout_s)
                if self.retry_status is None or not self.retry_status(reply.status):
                    return reply
                error: Exception = HttpStatusError(reply, what)
            except TRANSPORT_ERRORS as e:
                error = e
            out_of_tries = self.retries is not None and attempt >= self.retries
            if out_of_tries or (deadline is not None and time.monotonic() >= deadline):
                raise self.unreachable(error, what) from error
            log.log(self.retry_log_level, "%s on %s failed (%s); retrying", what, self.url, error)
            time.sleep(backoff_s(attempt, self.backoff_s, self.max_backoff_s))
            attempt += 1

    def _send_once(
        self,
        method: str,
        path: str,
        data: bytes | None,
        headers: dict[str, str],
        timeout_s: float | None,
    ) -> Reply:
        conn = None
        try:
            conn = self.connection(timeout_s)
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            return Reply(resp.status, resp.read())
        finally:
            if conn is not None:
                conn.close()
