"""HTTP plumbing every RLAX service shares: the run's bearer token (docs/design.md §13), a FastAPI
app guarded by it and a body-size limit, bounded long-polls, and ``JsonClient`` with retries.

One token per run, ``RLAX_PS_TOKEN``, passed in the environment, never on a command line; a
service started without it refuses to start. JAX-free: FastAPI loads only where an app is built."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import http.client
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from rlax_tasks.services.endpoints import Endpoint
from rlax_tasks.utils.validation import check_number, field_error

log = logging.getLogger(__name__)

T = TypeVar("T")

# the run's bearer token, read by every service and client of the run (one token per run)
TOKEN_ENV = "RLAX_PS_TOKEN"
BEARER = "Bearer "
MISSING_TOKEN = "missing bearer token"
WRONG_TOKEN = "wrong bearer token"
# the longest wait any request may ask for (a service may answer a long-poll sooner)
MAX_WAIT_S = 300.0
# the body limit of a service's JSON requests unless it sets its own
DEFAULT_MAX_BODY_BYTES = 1 << 20
# what a request that never got a reply raises (refused, reset, timed out, cut short)
TRANSPORT_ERRORS = (OSError, http.client.HTTPException, EOFError)


# --------------------------------------------------------------------------- the run's token
def service_token(env: Mapping[str, str] | None = None) -> str:
    """The run's token, which a service needs to start: ``RLAX_PS_TOKEN``; ValueError (the
    command exits 2 with it) naming the variable when it is unset or empty."""
    token = (os.environ if env is None else env).get(TOKEN_ENV, "").strip()
    if not token:
        raise ValueError(
            f"{TOKEN_ENV} is not set: export the run's secret token (every service of a run "
            "and its clients share it; `rlax run` generates one)"
        )
    return token


def run_token(env: Mapping[str, str] | None = None) -> str:
    """The token of a new run: the user's ``RLAX_PS_TOKEN`` when exported, else a new random one
    (what a launcher passes to every job of the run in its environment)."""
    token = (os.environ if env is None else env).get(TOKEN_ENV, "").strip()
    return token or secrets.token_hex(16)


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


# --------------------------------------------------------------------------- request bounds
def check_wait_s(value: Any, field: str = "wait_s", maximum: float = MAX_WAIT_S) -> float:
    """``value`` (a number or its text) as seconds to wait: finite, in [0, ``maximum``];
    ValueError naming ``field`` otherwise (a NaN or infinite wait would spin or hang a thread)."""
    seconds = check_number(field, value, field_error(ValueError), low=0.0, from_text=True)
    if seconds > maximum:
        raise ValueError(f"{field} must be at most {maximum:g} seconds, got {seconds:g}")
    return seconds


async def long_poll(
    poll: Callable[[], list[T]], wait_s: float, interval_s: float = 0.05
) -> list[T]:
    """``poll()`` until it returns a non-empty list or ``wait_s`` passed, sleeping on the event
    loop in between: a waiting request holds no thread (any number of them leave the service's
    other routes their thread pool), and a shutdown cancels it at once."""
    deadline = time.monotonic() + wait_s
    while True:
        found = poll()
        left = deadline - time.monotonic()
        if found or left <= 0:
            return found
        await asyncio.sleep(min(interval_s, left))


class RequestGuard:
    """ASGI middleware in front of every route of a service: the bearer token first (401 / 403
    before any byte of the body is read), then the body size: 413 when the ``Content-Length``
    exceeds ``max_body_bytes`` (before reading), or as soon as a streamed (chunked) body read so
    far does."""

    def __init__(self, app: Any, token: str, max_body_bytes: int) -> None:
        self.app, self.token, self.max_body_bytes = app, token, max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        # lazy: only a served app loads the web framework (light clients)
        from starlette.datastructures import Headers
        from starlette.exceptions import HTTPException

        headers = Headers(scope=scope)
        try:
            check_bearer(headers.get("authorization"), self.token)
        except AuthError as e:
            return await _refuse(scope, receive, send, e.status, e.message, e.headers)
        length = headers.get("content-length")
        if length is not None and not length.isdigit():
            return await _refuse(scope, receive, send, 400, f"bad Content-Length {length[:32]!r}")
        if length is not None and int(length) > self.max_body_bytes:
            return await _refuse(scope, receive, send, 413, self._too_large(int(length)))
        received = 0

        async def bounded_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, self._too_large(received, streamed=True))
            return message

        await self.app(scope, bounded_receive, send)

    def _too_large(self, nbytes: int, streamed: bool = False) -> str:
        what = f"more than {nbytes} bytes" if streamed else f"{nbytes} bytes"
        return f"request body of {what} exceeds this service's limit of {self.max_body_bytes}"


async def _refuse(
    scope: dict,
    receive: Callable,
    send: Callable,
    status: int,
    message: str,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Answers ``{"detail": message}`` with ``status`` (as FastAPI's errors read), closing the
    connection: the body the client may still be sending is never read."""
    # lazy: only a served app loads the web framework (light clients)
    from starlette.responses import JSONResponse

    reply = JSONResponse({"detail": message}, status, {**(headers or {}), "Connection": "close"})
    await reply(scope, receive, send)


def authorized_app(
    title: str, token: str, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, **kwargs: Any
) -> Any:
    """A FastAPI application whose every request needs ``token`` as its bearer token and has a
    body of at most ``max_body_bytes`` (``RequestGuard``); no API docs routes (they would be
    served to anyone). ValueError without a token: a service never runs open."""
    # lazy: only a served app loads the web framework (light clients)
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError

    if not token:
        raise ValueError(f"{title}: no bearer token (set {TOKEN_ENV})")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    options = {"docs_url": None, "redoc_url": None, "openapi_url": None, **kwargs}
    app = FastAPI(title=title, **options)
    app.add_middleware(RequestGuard, token=token, max_body_bytes=max_body_bytes)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    return app


async def _invalid_request(request: Any, exc: Any) -> Any:
    """422 naming each invalid field and why, without echoing its value (a NaN or infinite
    number would not even encode as JSON: FastAPI's own answer fails with a 500)."""
    # lazy: only a served app loads the web framework (light clients)
    from starlette.responses import JSONResponse

    errors = [
        {"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg")), "type": e.get("type")}
        for e in exc.errors()
    ]
    return JSONResponse({"detail": errors}, 422)


def serve_app(
    app: Any,
    sock: socket.socket,
    log_level: str = "warning",
    graceful_s: float | None = None,
    until: threading.Event | None = None,
    **config: Any,
) -> None:
    """Serves an ASGI ``app`` with uvicorn on ``sock`` (from ``endpoints.listen``) until it is
    stopped (SIGINT / SIGTERM, or ``until`` set: the service can no longer do its work);
    requests still running ``graceful_s`` after that are cancelled (None: waited for)."""
    # lazy: only a served app loads the web framework (light clients)
    import uvicorn

    uv_config = uvicorn.Config(
        app, log_level=log_level, timeout_graceful_shutdown=graceful_s, **config
    )
    server = uvicorn.Server(uv_config)
    if until is not None:

        def stop_when_set() -> None:
            until.wait()
            server.should_exit = True

        threading.Thread(target=stop_when_set, name="serve-until", daemon=True).start()
    server.run(sockets=[sock])


# --------------------------------------------------------------------------- client
def backoff_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Seconds to wait after failed attempt ``attempt`` (0-based): ``base_s`` doubled per
    attempt, at most ``cap_s``."""
    return min(base_s * 2**attempt, cap_s)


class ReplyTooLargeError(ValueError):
    """A service answered with a body longer than its client takes (never retried)."""


@dataclasses.dataclass(frozen=True)
class Reply:
    """A service's answer: its HTTP status and body, and how many times the request was sent
    to get it (> 1: an earlier attempt may have reached the service without an answer)."""

    status: int
    body: bytes
    attempts: int = 1

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
    """JSON requests to one service at its ``Endpoint`` (a URL, or the service file it publishes).

    A request with no reply or a ``retry_status`` reply is sent again with doubling ``backoff_s``,
    up to ``retries`` / ``give_up_after_s`` (None: no limit), then ``unreachable(error, what)`` is
    raised; a status >= 300 raises ``refused(reply, what)``. Thread-safe."""

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
        max_reply_bytes: int | None = None,
    ) -> None:
        """``max_reply_bytes``: a longer reply body is not read past it (ReplyTooLargeError);
        None: no limit."""
        self.endpoint = endpoint if isinstance(endpoint, Endpoint) else Endpoint(endpoint)
        self.max_reply_bytes = max_reply_bytes
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
                    return dataclasses.replace(reply, attempts=attempt + 1)
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
            limit = self.max_reply_bytes
            if limit is None:
                return Reply(resp.status, resp.read())
            body = resp.read(limit + 1)
            if len(body) > limit:
                raise ReplyTooLargeError(
                    f"{method} {path} on {self.url}: the reply exceeds {limit} bytes"
                )
            return Reply(resp.status, body)
        finally:
            if conn is not None:
                conn.close()


def send_json(
    handler: Any, status: int, obj: Any, close: bool = False, headers: dict | None = None
) -> None:
    """Answers a ``http.server`` request with ``obj`` as JSON (204: no body); one writer for all."""
    data = b"" if status == 204 else json.dumps(obj).encode()
    handler.send_response(status)
    for key, value in (headers or {}).items():
        handler.send_header(key, value)
    if status != 204:
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
    if close:
        handler.send_header("Connection", "close")
        handler.close_connection = True
    handler.end_headers()
    if data:
        handler.wfile.write(data)
