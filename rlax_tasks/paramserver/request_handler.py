"""The parameter server's HTTP request handler: routes, request bodies and the pull answers.

One request per call on the standard library's threading server (docs/design.md §6 explains why
not FastAPI); bodies stream between the socket and numpy buffers. Routes: above
``RequestHandler._route`` (every one needs the run's token, docs/design.md §13)."""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import re
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

from rlax_tasks.paramserver import shared_memory
from rlax_tasks.paramserver.delta import delta_frames
from rlax_tasks.paramserver.egress import ThrottledWriter
from rlax_tasks.paramserver.errors import (
    NoRoomError,
    PartsMissingError,
    UnknownVersionError,
    VersionConflictError,
    VersionGoneError,
    VersionTooLargeError,
)
from rlax_tasks.paramserver.protocol import (
    DELTA_TYPE,
    MAX_JSON_BYTES,
    MAX_PARTS,
    PART_HEADER,
    PARTS_HEADER,
    RELAY_HEADER,
    SHARED_MEMORY_TYPE,
    VERSION_HEADER,
    WORKER_HEADER,
)
from rlax_tasks.paramserver.versions import WeightVersion
from rlax_tasks.paramserver.wire import ChecksumError, WireError
from rlax_tasks.services.http import MAX_WAIT_S, AuthError, check_bearer, check_wait_s, send_json

if TYPE_CHECKING:
    from rlax_tasks.paramserver.server import ParameterServer

log = logging.getLogger(__name__)

_WORKER_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")


class _HTTPError(Exception):
    """A refused request: its status and message, whether the connection ends, extra headers."""

    def __init__(
        self, status: int, message: str, close: bool = False, headers: dict | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.close = status, message, close
        self.headers = headers or {}


class RequestHandler(http.server.BaseHTTPRequestHandler):
    """One request of a parameter server (a subclass per server sets ``ps`` and ``timeout``)."""

    protocol_version = "HTTP/1.1"
    server_version = "rlax-ps/1"
    # TCP_NODELAY: a reply's headers and its small body are separate writes; without it the body
    # waits for the client's delayed ACK on a kept-alive connection
    disable_nagle_algorithm = True
    ps: ParameterServer  # set on the subclass built in ParameterServer.start

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s " + format, self.address_string(), *args)

    def setup(self) -> None:
        """The connection's files; with an egress limit every byte sent passes its bucket."""
        super().setup()
        if self.ps.egress is not None:
            self.wfile = ThrottledWriter(self.wfile, self.ps.egress)

    # ------------------------------------------------------------------ dispatch
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        parts = [p for p in url.path.split("/") if p]
        self._body_left = 0
        try:
            self._authenticate()
            self._body_left = self._body_length(method)
            worker = self.headers.get(WORKER_HEADER)
            if worker:
                self.ps.store.touch(_worker_id(worker))
            self._route(method, parts, query)
            if self._body_left:  # a body the route did not read: the connection cannot go on
                self.close_connection = True
        except _HTTPError as e:
            close = e.close or self._body_left > 0  # an unread body: the connection ends
            send_json(self, e.status, {"error": e.message}, close=close, headers=e.headers)
        except (TimeoutError, ConnectionError, EOFError) as e:
            log.warning("%s %s from %s aborted: %r", method, url.path, self.client_address, e)
            self.close_connection = True

    # Routes (Authorization: Bearer <token>: missing 401, wrong 403; X-RLAX-Worker: <id> on any
    # request registers the worker and counts as a heartbeat):
    #   GET /v1/status, /v1/latest, /v1/pull?min_version=&wait_s= (long poll; 204: none yet);
    #     a pull or GET of a version with have=<u>&have_digest=<hex>: a delta when u is held here
    #   GET /v1/versions/<v> (404: not held); PUT /v1/versions/<v>: a push (409 unless newest)
    #   POST /v1/versions/<v>/reserve?wait_s= {"nbytes": n}: 200 (reserved for io_timeout_s),
    #     503 + Retry-After (no room yet: ask again) or 413 (can never fit)
    #   POST /v1/workers/<id>/register | heartbeat | ack {"version": v}; DELETE /v1/workers/<id>
    # A multi-host push (docs/design.md §6) sends X-RLAX-Push-Part/-Parts with its reserve and PUT;
    # each part is answered once the version is decided: 200, 400 (parts disagree, gap or overlap),
    # 422 (corrupt block), 408 (parts missing after assembly_timeout_s) or 409 (newer committed).
    def _route(self, method: str, parts: list[str], query: dict[str, list[str]]) -> None:
        ps = self.ps
        if parts[:1] != ["v1"]:
            raise _HTTPError(404, f"no route {self.path}")
        route = parts[1:]
        if method == "GET" and route == ["status"]:
            return send_json(self, 200, ps.status())
        if method == "GET" and route == ["latest"]:
            latest = ps.store.latest()
            if latest is None:
                return send_json(self, 200, {"version": None, "digest": None, "parts": None})
            parts = [d.hex() for d in latest.part_digests] or None
            return send_json(
                self,
                200,
                {"version": latest.version, "digest": latest.digest.hex(), "parts": parts},
            )
        if method == "GET" and route == ["pull"]:
            min_version = _int_param(query, "min_version")
            wait_s = min(_wait_param(query), ps.config.max_wait_s)
            weights = ps.store.wait_for(min_version, wait_s)
            while weights is not None:
                try:
                    return self._send_version(weights, query)
                except VersionGoneError:  # garbage-collected meanwhile: a newer one is in
                    weights = ps.store.wait_for(min_version, 0.0)
            return send_json(self, 204, None)
        if len(route) == 2 and route[0] == "versions":
            version = _int_segment(route[1], "version")
            if method == "GET":
                try:
                    return self._send_version(ps.store.get(version), query)
                except UnknownVersionError:
                    raise _HTTPError(
                        404, f"version {version} is not held (held: {ps.store.versions()})"
                    ) from None
            if method == "PUT":
                return self._push(version)
        if method == "POST" and len(route) == 3 and route[0] == "versions":
            if route[2] == "reserve":
                return self._reserve(_int_segment(route[1], "version"), query)
        if len(route) >= 2 and route[0] == "workers":
            worker = _worker_id(route[1])
            if method == "DELETE" and len(route) == 2:
                ps.store.deregister(worker)
                return send_json(self, 200, {"worker": worker, "registered": False})
            if method == "POST" and len(route) == 3 and route[2] in ("register", "heartbeat"):
                ps.store.touch(worker)
                return send_json(self, 200, {"worker": worker, "registered": True})
            if method == "POST" and len(route) == 3 and route[2] == "ack":
                body = self._read_json()
                version = body.get("version")
                if isinstance(version, bool) or not isinstance(version, int) or version < 0:
                    raise _HTTPError(400, 'ack body must be {"version": <int >= 0>}')
                try:
                    deleted = ps.store.ack(worker, version)
                except UnknownVersionError:
                    raise _HTTPError(
                        400, f"cannot ack version {version}: latest is {ps.store.latest_version()}"
                    ) from None
                return send_json(self, 200, {"worker": worker, "acked": version, "gc": deleted})
        raise _HTTPError(404, f"no route {method} {self.path}")

    # ------------------------------------------------------------------ auth
    def _authenticate(self) -> None:
        try:
            check_bearer(self.headers.get("Authorization"), self.ps.config.token, realm="rlax-ps")
        except AuthError as e:
            raise _HTTPError(e.status, e.message, close=True, headers=e.headers) from None

    # ------------------------------------------------------------------ bodies
    def _reserve(self, version: int, query: dict[str, list[str]]) -> None:
        nbytes = self._read_json().get("nbytes")
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise _HTTPError(400, 'reserve body must be {"nbytes": <int >= 0>}')
        wait_s = min(_wait_param(query), self.ps.config.max_wait_s)
        part = self._part()
        try:
            self.ps.store.reserve(
                version,
                nbytes,
                wait_s,
                lease_s=self.ps.config.io_timeout_s,
                parts=None if part is None else part[1],
            )
        except VersionConflictError as e:
            raise _HTTPError(409, str(e)) from None
        except WireError as e:
            raise _HTTPError(400, f"push of version {version} rejected: {e}") from None
        except VersionTooLargeError as e:
            raise _HTTPError(413, f"push of version {version} refused: {e}") from None
        except NoRoomError as e:
            raise _HTTPError(503, str(e), headers={"Retry-After": "1"}) from None
        send_json(
            self,
            200,
            {
                "version": version,
                "reserved": nbytes,
                "assembly_timeout_s": self.ps.config.assembly_timeout_s,
            },
        )

    def _push(self, version: int) -> None:
        length = self.headers.get("Content-Length")
        if length is None:
            raise _HTTPError(411, "push needs a Content-Length", close=True)
        self._body_left = 0  # read (or refused with the connection closed) from here on
        part = self._part(close=True)
        what = f"push of version {version}"
        try:
            if part is None:
                weights = self.ps.receiver.receive_push(version, self.rfile, int(length))
            else:
                what += f" (part {part[0]} of {part[1]})"
                weights = self.ps.receiver.receive_part(version, *part, self.rfile, int(length))
        except PartsMissingError as e:
            raise _HTTPError(408, f"{what} failed: {e}", close=True) from None
        except VersionConflictError as e:
            raise _HTTPError(409, str(e), close=True) from None
        except VersionTooLargeError as e:
            raise _HTTPError(413, f"push of version {version} refused: {e}", close=True) from None
        except NoRoomError as e:
            raise _HTTPError(503, str(e), close=True, headers={"Retry-After": "1"}) from None
        except ChecksumError as e:
            raise _HTTPError(422, f"{what} rejected: {e}", close=True) from None
        except WireError as e:
            raise _HTTPError(400, f"{what} rejected: {e}", close=True) from None
        except (TimeoutError, ConnectionError, EOFError) as e:
            log.warning("%s broke off and was discarded: %r", what, e)
            self.close_connection = True
            return
        reply = {"version": weights.version, "bytes": weights.manifest.nbytes}
        if part is not None:
            reply.update(part=part[0], parts=part[1])
        send_json(self, 200, reply)

    def _part(self, close: bool = False) -> tuple[int, int] | None:
        """(part, parts) of a multi-host push from its headers; None for a single-host push."""
        raw = self.headers.get(PART_HEADER), self.headers.get(PARTS_HEADER)
        if raw == (None, None):
            return None
        try:
            part, parts = int(raw[0] or ""), int(raw[1] or "")
        except ValueError:
            part = parts = -1
        if not (1 <= parts <= MAX_PARTS and 0 <= part < parts):
            raise _HTTPError(
                400,
                f"{PART_HEADER}: {str(raw[0])[:16]} / {PARTS_HEADER}: {str(raw[1])[:16]}: send "
                f"both, integers with 0 <= part < parts <= {MAX_PARTS}",
                close=close,
            )
        return part, parts

    def _send_version(self, weights: WeightVersion, query: dict[str, list[str]]) -> None:
        """The version's wire stream; or, to a puller on this host (its ``local`` identity is
        ours), where the version lies in shared memory; or, to one that holds a version still
        held here (``have``, with its digest), the changes since that one."""
        local = query.get("local", [""])[0]
        with weights.pinned():  # VersionGoneError (404) if it was recycled meanwhile
            if local and local == shared_memory.host_identity() and weights.shared():
                return self._send_descriptor(weights)
            base = self._delta_base(weights, query)
            if base is not None:
                try:
                    with base.pinned():
                        return self._send_delta(weights, base)
                except VersionGoneError:  # the base was recycled meanwhile: the whole version
                    pass
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(weights.stream_length()))
            self.send_header(VERSION_HEADER, str(weights.version))
            self.end_headers()
            t0 = time.perf_counter()
            relay = self.headers.get(RELAY_HEADER) == "1" and self.ps.egress is not None
            with self.wfile.sending_first() if relay else contextlib.nullcontext():
                for frame in weights.frames():
                    self.wfile.write(frame)
        log.debug("served version %d in %.2fs", weights.version, time.perf_counter() - t0)

    def _delta_base(
        self, weights: WeightVersion, query: dict[str, list[str]]
    ) -> WeightVersion | None:
        """The version the puller holds (``have``) when it is held here with the same content
        (``have_digest``) and the same arrays as ``weights``: the base of a delta pull."""
        have = _int_param(query, "have")
        if have is None or have > weights.version:
            return None
        try:
            base = self.ps.store.get(have)
        except UnknownVersionError:
            return None
        same_arrays = base.manifest.arrays == weights.manifest.arrays
        if not same_arrays or query.get("have_digest", [""])[0] != base.digest.hex():
            return None
        return base

    def _send_delta(self, weights: WeightVersion, base: WeightVersion) -> None:
        """``weights`` as a delta against ``base`` (both pinned), chunked: its length is known
        only once each block is encoded, one at a time."""
        self.send_response(200)
        self.send_header("Content-Type", DELTA_TYPE)
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header(VERSION_HEADER, str(weights.version))
        self.end_headers()
        t0, sent = time.perf_counter(), 0
        frames = delta_frames(
            weights.manifest, [(b.header, b.data) for b in weights.blocks], base.version,
            [(b.header, b.data) for b in base.blocks], weights.digest,
        )  # fmt: skip
        for frame in frames:
            size = len(frame) if isinstance(frame, bytes) else frame.nbytes
            if size:
                self.wfile.write(f"{size:x}\r\n".encode())
                self.wfile.write(frame if isinstance(frame, bytes) else memoryview(frame))
                self.wfile.write(b"\r\n")
                sent += size
        self.wfile.write(b"0\r\n\r\n")
        log.debug(
            "served version %d as a delta from %d (%d of %d bytes) in %.2fs", weights.version,
            base.version, sent, weights.stream_length(), time.perf_counter() - t0,
        )  # fmt: skip

    def _send_descriptor(self, weights: WeightVersion) -> None:
        segments = weights.segments()
        index = {id(s): i for i, s in enumerate(segments)}
        body = json.dumps(
            {
                "manifest": weights.manifest.to_json(),
                "digest": weights.digest.hex(),
                "segments": [s.describe() for s in segments],
                "live": self.ps.segments.live_inodes(),  # the rest, readers may let go of
                "blocks": [
                    [b.header.encode().hex(), index[id(b.segment)], b.offset]
                    for b in weights.blocks
                ],
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", SHARED_MEMORY_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.send_header(VERSION_HEADER, str(weights.version))
        self.end_headers()
        self.wfile.write(body)

    def _body_length(self, method: str) -> int:
        """The request's Content-Length, checked before any of the body is read: digits only,
        no chunked body (411), at most ``MAX_JSON_BYTES`` unless it is a push (413)."""
        if self.headers.get("Transfer-Encoding"):
            raise _HTTPError(411, "send a Content-Length (no chunked bodies)", close=True)
        raw = self.headers.get("Content-Length")
        if raw is None:
            return 0
        if not raw.isdigit():
            raise _HTTPError(400, f"bad Content-Length {raw[:32]!r}", close=True)
        length = int(raw)
        if method != "PUT" and length > MAX_JSON_BYTES:
            raise _HTTPError(
                413,
                f"a body of {length} bytes exceeds the limit of {MAX_JSON_BYTES} for JSON requests",
                close=True,
            )
        return length

    def _read_json(self) -> dict:
        length, self._body_left = self._body_left, 0
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            raise _HTTPError(400, "body is not JSON") from None
        if not isinstance(body, dict):
            raise _HTTPError(400, "body must be a JSON object")
        return body


def _worker_id(raw: str) -> str:
    if not _WORKER_ID.match(raw):
        raise _HTTPError(400, f"bad worker id {raw[:64]!r}: use 1-128 of [A-Za-z0-9._:@-]")
    return raw


def _int_segment(raw: str, what: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise _HTTPError(400, f"{what} must be an integer >= 0, got {raw[:32]!r}")
    return value


def _int_param(query: dict[str, list[str]], name: str) -> int | None:
    values = query.get(name)
    return None if not values or values[0] == "" else _int_segment(values[0], name)


def _wait_param(query: dict[str, list[str]], name: str = "wait_s") -> float:
    """The ``wait_s`` of a long-poll (0 when absent): finite, in [0, MAX_WAIT_S], else 400."""
    values = query.get(name)
    if not values:
        return 0.0
    try:
        return check_wait_s(values[0][:64], name, MAX_WAIT_S)
    except ValueError as e:
        raise _HTTPError(400, str(e)) from None
