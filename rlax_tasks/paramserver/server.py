"""The parameter server: versioned weights over HTTP with streaming bodies, and `rlax ps serve`.

HTTP/1.1 on the standard library's threading server (gRPC would copy each message to protobuf).
Bodies stream between sockets and numpy buffers, each block's CRC32C checked on arrival: a bad or
broken push is refused before it is visible. Routes: above ``_Handler._route`` (token needed)."""

from __future__ import annotations

import argparse
import dataclasses
import http.server
import json
import logging
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse
from typing import Any

import numpy as np

from rlax_tasks.paramserver import mirror as mirror_mod
from rlax_tasks.paramserver import shared_memory
from rlax_tasks.paramserver.delta import delta_frames
from rlax_tasks.paramserver.store import (
    Assembly,
    Block,
    NoRoomError,
    PartsMissingError,
    UnknownVersionError,
    VersionConflictError,
    VersionGoneError,
    VersionStore,
    VersionTooLargeError,
    WeightVersion,
)
from rlax_tasks.paramserver.wire import (
    END_FRAME_SIZE,
    ChecksumError,
    Manifest,
    WireError,
    block_header_size,
    check_coverage,
    crc32c,
    read_block_header,
    read_end,
    read_manifest,
    version_digest,
)
from rlax_tasks.rundir.storage import read_into
from rlax_tasks.services.endpoints import add_address_args, announce, bind_host, listen
from rlax_tasks.services.http import (
    MAX_WAIT_S,
    TOKEN_ENV,
    AuthError,
    check_bearer,
    check_wait_s,
    send_json,
    service_token,
)
from rlax_tasks.utils.byte_sizes import parse_bytes_arg
from rlax_tasks.utils.validation import check_int, check_number, field_error

log = logging.getLogger(__name__)

# TOKEN_ENV (RLAX_PS_TOKEN, the run's token) and MAX_WAIT_S: from rlax_tasks.services.http
MAX_JSON_BYTES = 65536  # a JSON request body (reserve, ack)
WORKER_HEADER = "X-RLAX-Worker"
VERSION_HEADER = "X-RLAX-Version"
PART_HEADER = "X-RLAX-Push-Part"  # this push is part i (0-based) ...
PARTS_HEADER = "X-RLAX-Push-Parts"  # ... of n parts of a multi-host version
# a pull answered with where the version lies in shared memory (the puller is on this host)
SHARED_MEMORY_TYPE = "application/vnd.rlax.shared-memory+json"
# a pull answered with the changes since the version the puller holds (its ``have`` and
# ``have_digest``): rlax_tasks/paramserver/delta.py, sent chunked
DELTA_TYPE = "application/vnd.rlax.weights-delta"
MAX_PARTS = 65536
_WORKER_ID = re.compile(r"^[A-Za-z0-9._:@-]{1,128}$")


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """Validated settings of one parameter server (errors name the field)."""

    token: str = dataclasses.field(repr=False)
    host: str = "127.0.0.1"
    port: int = 0
    run_root: str | None = None  # local dir or gs://...; None: no durable mirror
    keep_versions: int = 2
    keep_bytes: int | None = None  # array payload held in RAM (versions + pushes); None: no limit
    mirror_every: int = 1
    mirror_keep: int = 2
    worker_timeout_s: float = 60.0
    io_timeout_s: float = 30.0  # any socket read/write stalled longer aborts that request
    max_wait_s: float = 30.0  # longest server-side long poll of one pull request
    verify_push: bool = True  # check every pushed block's CRC32C before the version is visible
    hash_threads: int = 0  # ignored (CRC32C is checked inline); kept for existing configs
    assembly_timeout_s: float = 600.0  # every part of a multi-host push within this of the first
    # versions live in shared memory; pulls from this host copy them from there, not over TCP
    shared_memory: bool = True

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError(f"token is empty: set {TOKEN_ENV} to a secret string")
        error = field_error(ValueError)
        check_int("port", self.port, error, minimum=0, maximum=65535)
        for name in ("keep_versions", "mirror_every", "mirror_keep"):
            check_int(name, getattr(self, name), error, minimum=1)
        check_int("keep_bytes", self.keep_bytes, error, minimum=1, optional=True)
        for name in ("worker_timeout_s", "io_timeout_s", "max_wait_s", "assembly_timeout_s"):
            check_number(name, getattr(self, name), error, low=0, open_low=True)
        check_int("hash_threads", self.hash_threads, error, minimum=0)


class _HTTPError(Exception):
    def __init__(
        self, status: int, message: str, close: bool = False, headers: dict | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.close = status, message, close
        self.headers = headers or {}


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
        handler = type("Handler", (_Handler,), {"ps": self, "timeout": self.config.io_timeout_s})
        sock, self._address = listen(self.config.host, self.config.port, _Server.request_queue_size)
        self._httpd = _Server(sock, handler)
        for target, name in ((self._httpd.serve_forever, "ps-http"), (self._reap, "ps-reaper")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
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
            "mirror": None
            if self.mirror is None
            else {"last_committed": self.mirror.last_committed, "errors": self.mirror.errors},
        }

    # ------------------------------------------------------------------ push
    def receive_push(self, version: int, body: Any, length: int) -> WeightVersion:
        """Reads a pushed wire stream; the version becomes visible only once complete and valid."""
        self.store.begin_push(version)
        try:
            t0 = time.perf_counter()
            reader = _Bounded(body, length)
            manifest = self._read_manifest(reader, version)
            check_stream_length(manifest, reader.left)  # before any block is read
            self.store.fit_push(version, manifest.nbytes)  # its room, before any block arrives
            try:
                blocks = self._read_blocks(reader, manifest)
            except (ChecksumError, WireError):
                reader.drain()  # the rest of the body first: the pusher then reads our answer
                raise
            check_coverage(manifest, (b.header for b in blocks))
            weights = WeightVersion(
                manifest, blocks, version_digest(manifest, [b.header for b in blocks])
            )
            self.store.commit(weights)
            self._committed(weights, time.perf_counter() - t0)
            return weights
        finally:
            self.store.end_push(version)

    def receive_part(
        self, version: int, part: int, parts: int, body: Any, length: int
    ) -> WeightVersion:
        """Reads part ``part`` of ``parts`` of a multi-host version; returns once the version is
        committed (this part or another was the last), raises once it is abandoned."""
        t0 = time.perf_counter()
        assembly = self.store.begin_part(version, part, parts)
        try:
            reader = _Bounded(body, length)
            try:
                manifest = self._read_manifest(reader, version)
                self.store.start_part(assembly, part, manifest)
                check_stream_length(manifest, reader.left)  # before any block is read
                blocks = self._read_blocks(reader, manifest, assembly)
            except VersionTooLargeError as e:  # its body is never read: the version fails
                self.store.fail_part(assembly, part, e)
                raise
            except (ChecksumError, WireError) as e:  # a broken or corrupted part: no retry fixes it
                reader.drain()  # the rest of the body first: the pusher then reads our answer
                self.store.fail_part(assembly, part, e)  # raises the version's error
                raise
            digest = version_digest(manifest, [b.header for b in blocks])
            weights = self.store.add_part(assembly, part, blocks, digest)
        finally:
            self.store.end_part_stream(assembly, part)
        if weights is None:
            log.info("version %d: part %d of %d in; waiting for the others", version, part, parts)
            return self.store.wait_assembled(assembly)
        self._committed(weights, time.perf_counter() - t0)
        return weights

    def _committed(self, weights: WeightVersion, seconds: float) -> None:
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

    @staticmethod
    def _read_manifest(reader: _Bounded, version: int) -> Manifest:
        manifest = read_manifest(reader)
        if manifest.version != version:
            raise WireError(f"manifest is for version {manifest.version}, URL for {version}")
        return manifest

    def _read_blocks(
        self, reader: _Bounded, manifest: Manifest, assembly: Assembly | None = None
    ) -> list[Block]:
        """The blocks of one stream up to its end frame, each read straight into its own buffer
        and CRC32C-checked there as soon as it is in (verify_push); then the end frame's digest.

        Stops early when the version being assembled is abandoned meanwhile (its error)."""
        blocks: list[Block] = []
        covered = [0] * len(manifest.arrays)
        segment, offset = self._take_segment(reader.left), 0
        for block_no in range(manifest.num_blocks):
            if assembly is not None and assembly.error is not None:
                kind, message = assembly.error
                raise kind(message)
            header = read_block_header(reader, manifest)
            spec = manifest.arrays[header.array]
            if covered[header.array] + header.nbytes > spec.nbytes:
                raise WireError(f"blocks of array {spec.name!r} exceed its {spec.nbytes} bytes")
            if header.nbytes > reader.left:  # never allocated beyond what the body still holds
                raise WireError(
                    f"block {block_no} of {header.nbytes} bytes, but the body has {reader.left} "
                    "left"
                )
            if segment is None:
                data = np.empty(header.nbytes, np.uint8)
            else:
                data = segment.data(offset, header.nbytes)
            read_into(reader, memoryview(data))
            if self.config.verify_push and (got := crc32c(data)) != header.crc32c:
                raise ChecksumError(
                    f"block {block_no} (array {spec.name!r}) fails its CRC32C (computed "
                    f"{got:#010x}, sent {header.crc32c:#010x})"
                )
            covered[header.array] += header.nbytes
            blocks.append(Block(header, data, segment, offset))
            offset += header.nbytes
        read_end(reader, manifest, [b.header for b in blocks])
        if reader.left:
            raise WireError(f"{reader.left} bytes after the end frame")
        if segment is not None:
            segment.stamp(manifest.version)  # complete and verified: same-host pulls may read it
        return blocks

    def _take_segment(self, nbytes: int) -> shared_memory.Segment | None:
        """Shared memory for a stream's blocks (at most ``nbytes``); None (private memory) when
        shared memory is off or full."""
        if self.segments is None:
            return None
        try:
            return self.segments.take(nbytes)
        except OSError as e:  # /dev/shm full or memfd refused: the bytes still arrive
            log.warning("no shared memory for %d bytes (%s); using private memory", nbytes, e)
            return None


class _Server(http.server.ThreadingHTTPServer):
    """Serves on a socket already listening (``endpoints.listen``: the one bind every service
    shares, IPv6 too)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

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


def check_stream_length(manifest: Manifest, left: int) -> None:
    """VersionTooLargeError when the ``left`` bytes after the manifest exceed what its blocks
    and end frame can take: the arrays' bytes, a header per block (a block holds at least one
    byte, so at most that many headers) and the end frame."""
    ndim = max((len(a.shape) for a in manifest.arrays), default=0)
    headers = min(manifest.num_blocks, manifest.nbytes) * block_header_size(ndim)
    most = manifest.nbytes + headers + END_FRAME_SIZE
    if left > most:
        raise VersionTooLargeError(
            f"the body holds {left} bytes after the manifest of version {manifest.version}, "
            f"more than its {manifest.num_blocks} blocks of {manifest.nbytes} array bytes can "
            f"take ({most})"
        )


class _Bounded:
    """A reader that never reads past ``length`` bytes of a request body."""

    def __init__(self, raw: Any, length: int) -> None:
        self.raw, self.left = raw, length

    def readinto(self, buf: memoryview) -> int:
        if self.left <= 0:
            return 0
        view = buf[: self.left] if len(buf) > self.left else buf
        k = self.raw.readinto(view)
        self.left -= k or 0
        return k or 0

    def drain(self) -> None:
        """Reads and drops the rest of the body (a refused push): the client is still sending
        it, and closing on it would reset the connection before it reads the refusal."""
        scratch = memoryview(bytearray(1 << 20))
        while self.left > 0 and self.readinto(scratch):
            pass


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "rlax-ps/1"
    ps: ParameterServer  # set on the subclass built in ParameterServer.start

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("%s " + format, self.address_string(), *args)

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
                weights = self.ps.receive_push(version, self.rfile, int(length))
            else:
                what += f" (part {part[0]} of {part[1]})"
                weights = self.ps.receive_part(version, *part, self.rfile, int(length))
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


# --------------------------------------------------------------------------- CLI
def add_ps_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax ps serve`."""
    ps = sub.add_parser("ps", help="parameter server")
    ps_sub = ps.add_subparsers(dest="ps_command", required=True)
    p = ps_sub.add_parser(
        "serve",
        help="serve weight versions (token from $RLAX_PS_TOKEN); prints its URL on stdout line 1",
    )
    add_address_args(p)
    p.add_argument("--run-root", default=None, help="local dir or gs:// URI for the mirror")
    p.add_argument("--keep-versions", type=int, default=2)
    p.add_argument(
        "--keep-bytes",
        type=parse_bytes_arg,
        default=None,
        metavar="SIZE",
        help="most weight bytes held in RAM (versions + pushes in flight), e.g. 64GiB, 500MB or "
        "a plain integer; a push that does not fit waits for workers' acks (default: no limit)",
    )
    p.add_argument("--mirror-every", type=int, default=1)
    p.add_argument("--mirror-keep", type=int, default=2, help="committed mirrors to keep")
    p.add_argument("--worker-timeout", type=float, default=60.0, help="seconds without contact")
    p.add_argument("--io-timeout", type=float, default=30.0, help="socket stall limit, seconds")
    p.add_argument(
        "--no-verify-push", action="store_true", help="skip the server-side CRC32C check of pushes"
    )
    p.add_argument(
        "--no-shared-memory",
        action="store_true",
        help="keep versions in private memory: workers on this host pull over TCP too",
    )
    p.add_argument(
        "--assembly-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="a multi-host push is discarded unless every trainer host's part arrives within "
        "this many seconds of the first (default 600)",
    )

    def run(args: argparse.Namespace) -> int:
        token = service_token()
        config = ServerConfig(
            token=token,
            host=bind_host(args.host),
            port=args.port,
            run_root=args.run_root,
            keep_versions=args.keep_versions,
            keep_bytes=args.keep_bytes,
            mirror_every=args.mirror_every,
            mirror_keep=args.mirror_keep,
            worker_timeout_s=args.worker_timeout,
            io_timeout_s=args.io_timeout,
            verify_push=not args.no_verify_push,
            assembly_timeout_s=args.assembly_timeout,
            shared_memory=not args.no_shared_memory,
        )
        return serve_forever(config, publish_to=args.publish)

    p.set_defaults(func=run)


def serve_forever(config: ServerConfig, publish_to: str | None = None) -> int:
    """Runs a server until SIGINT/SIGTERM; its URL is the first line on stdout (and written to
    the service file ``publish_to``, rlax_tasks.services.endpoints)."""
    server = ParameterServer(config).start()
    announce(server.address, publish_to)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        done.wait()
    finally:
        server.stop()
    log.info("parameter server stopped")
    return 0
