"""``ParameterServerClient``: push weights (trainer) and pull them (workers) over HTTP.

Both sides stream block by block (``push_plan`` reads a push's blocks from the device shards,
``receive`` checks a pull's blocks into host arrays, ``placement`` puts those onto devices): each
holds one copy of the weights plus a chunk. A worker pulling over TCP also keeps a host copy of
the version it holds, so the next pull brings only what changed (``delta``). Every call has
timeouts: a dead server hangs none."""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
import urllib.parse
from typing import Any

import numpy as np

from rlax_tasks.paramserver import shared_memory as shm
from rlax_tasks.paramserver.errors import (
    AuthenticationError,
    CorruptedWeightsError,
    ParameterServerError,
    PullTimeoutError,
    PushAssemblyTimeoutError,
    PushTimeoutError,
    ServerUnavailableError,
)
from rlax_tasks.paramserver.naming import flatten_named
from rlax_tasks.paramserver.push_plan import PlannedBlock, plan_leaf, push_part
from rlax_tasks.paramserver.receive import (
    Counting,
    HeldVersion,
    PullStats,
    check_out_alone,
    read_delta,
    read_shared,
    read_stream,
)
from rlax_tasks.paramserver.server import (
    DELTA_TYPE,
    PART_HEADER,
    PARTS_HEADER,
    SHARED_MEMORY_TYPE,
    TOKEN_ENV,
    WORKER_HEADER,
)
from rlax_tasks.paramserver.store import VersionConflictError
from rlax_tasks.paramserver.wire import (
    DEFAULT_CHUNK_BYTES,
    END_FRAME_SIZE,
    BlockHeader,
    ChecksumError,
    Manifest,
    WireError,
    block_header_size,
    crc32c,
    end_frame,
    version_digest,
)
from rlax_tasks.services.endpoints import Endpoint
from rlax_tasks.services.http import MAX_WAIT_S, JsonClient, Reply, backoff_s
from rlax_tasks.services.http import TRANSPORT_ERRORS as _TRANSPORT_ERRORS

log = logging.getLogger(__name__)

_RESERVE_POLL_S = 30.0  # longest one reserve request may be held (a stalled server: no hang)
_ASSEMBLY_TIMEOUT_S = 600.0  # the server's default, if its reserve reply does not say


class ParameterServerClient:
    """Client of one parameter server; thread-safe (each call opens its own connection)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        worker_id: str | None = None,
        timeout_s: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        retries: int = 3,
        hash_threads: int = 0,
        push_wait_s: float = 600.0,
        shared_memory: bool = True,
        delta: bool = True,
    ) -> None:
        """``shared_memory``: on the server's host, pulls copy a version out of the server's
        shared memory instead of receiving it over TCP (same checks; TCP when it is not
        possible). ``delta``: after a pull over TCP, keep a host copy of the version so the next
        pull receives only the changed elements. ``hash_threads`` is ignored: CRC32C runs
        inline (google_crc32c holds the GIL for numpy buffers: a thread pool was no faster)."""
        del hash_threads
        # a URL, or the service file the PS publishes its address to (followed when it moves)
        self._endpoint = Endpoint(url)
        token = token if token is not None else os.environ.get(TOKEN_ENV, "")
        if not token:
            raise ValueError(f"token is empty: pass token= or set {TOKEN_ENV}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if chunk_bytes < 1024:
            raise ValueError(f"chunk_bytes must be >= 1024, got {chunk_bytes}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if push_wait_s < 0:
            raise ValueError(f"push_wait_s must be >= 0, got {push_wait_s}")
        self.worker_id = worker_id
        self.timeout_s, self.chunk_bytes, self.retries = timeout_s, chunk_bytes, retries
        self.push_wait_s = push_wait_s
        self._local = shm.host_identity() if shared_memory else ""
        self._transport = ""  # how the last pull came: "shared memory" or "TCP"
        self._segments = shm.SegmentReader()  # the server's segments, mapped between pulls
        self.delta = delta
        self._held: HeldVersion | None = None  # taken by a pull while it rebuilds or replaces it
        self._held_lock = threading.Lock()
        self.last_pull: PullStats | None = None
        self._heartbeat_stop: threading.Event | None = None
        # the small JSON calls (the data plane streams over its own connections)
        self._http = JsonClient(
            self._endpoint, token, timeout_s=timeout_s, retries=retries, backoff_s=0.1,
            max_backoff_s=1.0, refused=self._refusal, unreachable=self._unavailable,
        )  # fmt: skip

    # ------------------------------------------------------------------ small calls
    def latest_version(self) -> int | None:
        """The newest version the server holds (None before the first push)."""
        return self._call("GET", "/v1/latest")["version"]

    def status(self) -> dict[str, Any]:
        """Versions held, registered workers and their acks, mirror state."""
        return self._call("GET", "/v1/status")

    def register(self) -> None:
        """Registers this worker: from now on it holds versions until it acks newer ones."""
        self._call("POST", f"/v1/workers/{self._require_worker()}/register")

    def heartbeat(self) -> None:
        """Tells the server this worker is alive (any call with a worker_id also does)."""
        self._call("POST", f"/v1/workers/{self._require_worker()}/heartbeat")

    def ack(self, version: int) -> None:
        """This worker now runs ``version``: versions older than it may be garbage-collected."""
        self._call("POST", f"/v1/workers/{self._require_worker()}/ack", {"version": int(version)})

    def deregister(self) -> None:
        """This worker leaves: it no longer holds any version."""
        self._call("DELETE", f"/v1/workers/{self._require_worker()}")

    def start_heartbeats(self, interval_s: float = 10.0) -> None:
        """Sends a heartbeat every ``interval_s`` on a daemon thread until ``close()``."""
        self._require_worker()
        if self._heartbeat_stop is not None:
            return
        stop = self._heartbeat_stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                try:
                    self.heartbeat()
                except ParameterServerError as e:
                    log.warning("heartbeat to %s failed: %s", self.url, e)

        threading.Thread(target=loop, name="ps-heartbeat", daemon=True).start()

    def close(self) -> None:
        """Stops heartbeats (the server forgets this worker after its timeout) and lets go of
        the server's shared memory."""
        if self._heartbeat_stop is not None:
            self._heartbeat_stop.set()
            self._heartbeat_stop = None
        self._segments.close()

    def __enter__(self) -> ParameterServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ push
    def push(self, version: int, params: Any) -> None:
        """Sends ``params`` (any pytree of arrays, named by dotted paths) as ``version``, newer
        than the server's latest; returns once it is visible. Waits up to ``push_wait_s`` for
        room in ``keep_bytes`` (PushTimeoutError). On a multi-host trainer every host calls it
        with the same arrays and sends its shards as one part (``push_plan``); all return once
        every part is in (PushAssemblyTimeoutError when one does not come in time)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be a non-negative int, got {version!r}")
        named = flatten_named(params)
        part = push_part(named.values())
        specs, plan = [], []
        for index, (name, leaf) in enumerate(named.items()):
            spec, blocks = plan_leaf(index, name, leaf, self.chunk_bytes, part)
            specs.append(spec)
            plan.extend(blocks)
        manifest = Manifest(version, tuple(specs), len(plan))
        length = len(manifest.encode()) + END_FRAME_SIZE
        length += sum(block_header_size(len(b.start)) + b.nbytes for b in plan)
        what = f"version {version}" + ("" if part is None else f" (part {part[0]} of {part[1]})")
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.push_wait_s
        digests: list[bytes] = []
        for attempt in range(self.retries + 1):
            try:
                reply = self._reserve(version, manifest.nbytes, deadline, part)
                hold_s = _assembly_timeout(reply)
                self._push_once(manifest, plan, length, digests, part, hold_s)
                break
            except VersionConflictError:
                if attempt and digests and self._committed_earlier(version, digests[-1], part):
                    break  # an earlier attempt did commit; the connection died before the reply
                raise
            except PushTimeoutError:
                raise  # a TimeoutError, hence an OSError: not a transport error to retry
            except _TRANSPORT_ERRORS as e:
                where = f"push of {what} to {self.url}"
                self._transfer_failed(e, attempt, where, attempt >= self.retries)
        log.info(
            "pushed %s (%.1f MB, %d blocks) in %.2fs",
            what,
            sum(b.nbytes for b in plan) / 1e6,
            len(plan),
            time.perf_counter() - t0,
        )

    def _push_once(
        self,
        manifest: Manifest,
        plan: list[PlannedBlock],
        length: int,
        digests: list[bytes],
        part: tuple[int, int] | None = None,
        hold_s: float = 0.0,
    ) -> None:
        what = f"push of version {manifest.version}"
        if part is not None:
            what += f" (part {part[0]} of {part[1]})"
        conn = self._connection(self.timeout_s)
        try:
            try:
                self._send_stream(conn, manifest, plan, length, digests, part)
            except _TRANSPORT_ERRORS:
                early = _early_reply(conn, min(self.timeout_s, 5.0))
                if early is None or early[0] < 300:
                    raise
                self._raise_for_status(*early, what)  # refused before the end: say why
            if part is not None:  # the reply waits until every host's part is in
                conn.sock.settimeout(self.timeout_s + hold_s)
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        self._raise_for_status(resp.status, body, what)

    def _send_stream(
        self,
        conn: http.client.HTTPConnection,
        manifest: Manifest,
        plan: list[PlannedBlock],
        length: int,
        digests: list[bytes],
        part: tuple[int, int] | None,
    ) -> None:
        """The PUT's headers and wire stream: each block's CRC32C is computed over the bytes
        about to be sent (the trainer's memory, or the block's host copy), then header and bytes
        go out; the end frame carries the digest (also appended to ``digests``)."""
        conn.putrequest("PUT", f"/v1/versions/{manifest.version}", skip_accept_encoding=True)
        for key, value in self._headers(part).items():
            conn.putheader(key, value)
        conn.putheader("Content-Type", "application/octet-stream")
        conn.putheader("Content-Length", str(length))
        conn.endheaders()
        conn.send(manifest.encode())
        headers = []
        for block in plan:
            view = block.fetch()
            header = BlockHeader(block.array, block.start, block.stop, block.nbytes, crc32c(view))
            headers.append(header)
            conn.send(header.encode())
            conn.send(view)
        digest = version_digest(manifest, headers)
        digests.append(digest)
        conn.send(end_frame(len(headers), digest))

    def _reserve(
        self, version: int, nbytes: int, deadline: float, part: tuple[int, int] | None = None
    ) -> dict:
        """Room for ``nbytes`` of ``version`` on the server, waiting (long polls) until deadline;
        the server's reply. The parts of a multi-host version share one reservation.

        Also fails fast on a bad token or a stale version number, before any block is sent.
        """
        path, waited = f"/v1/versions/{version}/reserve", False
        while True:
            left = min(max(deadline - time.monotonic(), 0.0), _RESERVE_POLL_S)
            query = urllib.parse.urlencode({"wait_s": f"{left:.3f}"})
            answer = self._http.send(
                "POST",
                f"{path}?{query}",
                {"nbytes": int(nbytes)},
                timeout_s=self.timeout_s + left,
                headers=self._extra_headers(part),
            )
            status, raw = answer.status, answer.body
            if status != 503:
                self._raise_for_status(status, raw, f"push of version {version}")
                if waited:
                    log.info("version %d has room on %s now: pushing", version, self.url)
                try:
                    reply = json.loads(raw)
                except ValueError:
                    reply = None
                return reply if isinstance(reply, dict) else {}
            message = _error_message(raw)
            if time.monotonic() >= deadline:
                raise PushTimeoutError(
                    f"push of version {version} to {self.url}: no room within "
                    f"push_wait_s={self.push_wait_s:g}s: {message}"
                )
            if not waited:
                log.warning("push of version %d waits on %s: %s", version, self.url, message)
                waited = True
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))

    def _committed_earlier(self, version: int, digest: bytes, part: tuple[int, int] | None) -> bool:
        """Whether the newest version is ``version`` as pushed with ``digest`` (of this part's
        blocks, for a part of a multi-host version)."""
        latest = self._call("GET", "/v1/latest")
        if latest.get("version") != version:
            return False
        if part is None:
            return latest.get("digest") == digest.hex()
        parts = latest.get("parts") or []
        return len(parts) == part[1] and parts[part[0]] == digest.hex()

    # ------------------------------------------------------------------ pull
    def pull(
        self,
        min_version: int | None = None,
        *,
        shardings: Any = None,
        like: Any = None,
        timeout_s: float | None = None,
        out: dict[str, np.ndarray] | None = None,
    ) -> tuple[int, Any]:
        """(version, params) of the newest version once it is >= ``min_version``, waiting at
        most ``timeout_s`` (PullTimeoutError): ``{name: np.ndarray}``, or placed by ``shardings``
        / a ``like`` template (``placement``). ``out``: an earlier pull's host arrays to receive
        into (contents undefined if it fails). A corrupted block pulls again, up to ``retries``
        times (CorruptedWeightsError)."""
        check_out_alone(out, shardings, like)
        wait_total = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_total
        failures = 0
        query = {} if min_version is None else {"min_version": int(min_version)}
        while True:
            left = deadline - time.monotonic()
            try:
                result = self._pull_once("/v1/pull", query, max(left, 0.0), shardings, like, out)
            except shm.SegmentGoneError as e:  # recycled before we read it: a newer one is in
                log.debug("%s; pulling again", e)
                result = None  # pulled again below, within the deadline like any other wait
            except (ChecksumError, WireError) as e:
                failures += 1
                if failures > self.retries:
                    raise CorruptedWeightsError(
                        f"pull from {self.url} failed verification {failures} times: {e}"
                    ) from e
                log.warning("pulled weights failed verification (%s); pulling again", e)
                continue
            except _TRANSPORT_ERRORS as e:
                failures += 1
                last = failures > self.retries or time.monotonic() >= deadline
                self._transfer_failed(e, failures - 1, f"pull from {self.url}", last)
                continue
            if result is not None:
                return result
            if time.monotonic() >= deadline:
                raise PullTimeoutError(
                    f"no version >= {min_version} on {self.url} within {wait_total:.1f}s"
                )

    def pull_version(
        self,
        version: int,
        *,
        shardings: Any = None,
        like: Any = None,
        out: dict[str, np.ndarray] | None = None,
    ) -> tuple[int, Any]:
        """A specific version (ParameterServerError if the server no longer holds it)."""
        check_out_alone(out, shardings, like)
        path = f"/v1/versions/{int(version)}"
        attempt = 0
        while True:
            try:
                result = self._pull_once(path, {}, 0.0, shardings, like, out)
                assert result is not None
                return result
            except shm.SegmentGoneError:  # gone from memory: asked again, the server says so
                continue
            except (ChecksumError, WireError) as e:
                if attempt == self.retries:
                    raise CorruptedWeightsError(
                        f"version {version} failed verification: {e}"
                    ) from e
                log.warning("version %d failed verification (%s); pulling again", version, e)
            except _TRANSPORT_ERRORS as e:
                what = f"pull of version {version} from {self.url}"
                self._transfer_failed(e, attempt, what, attempt >= self.retries)
            attempt += 1

    def _pull_once(
        self, path: str, query: dict, wait_s: float, shardings: Any, like: Any, out: Any
    ) -> tuple[int, Any] | None:
        asked = query
        if path == "/v1/pull":  # the server holds a poll for less anyway (its max_wait_s)
            wait_s = min(wait_s, MAX_WAIT_S)
            query = {**query, "wait_s": f"{wait_s:.3f}"}
        if self._local:  # on the server's host, it answers with where the version lies
            query = {**query, "local": self._local}
        held = self._take_held() if self.delta and out is None else None
        if held is not None:  # the server may answer with the changes since this one
            query = {**query, "have": held.manifest.version, "have_digest": held.digest.hex()}
        target = path + ("?" + urllib.parse.urlencode(query) if query else "")
        conn = self._connection(self.timeout_s + wait_s)
        consumed = False  # whether this pull rebuilt or replaced the held copy
        try:
            conn.request("GET", target, headers=self._headers())
            resp = conn.getresponse()
            if resp.status == 204:
                resp.read()
                return None
            if resp.status != 200:
                self._raise_for_status(resp.status, resp.read(), f"GET {path}")
            conn.sock.settimeout(self.timeout_s)  # the body: the normal stall limit again
            t0 = time.perf_counter()
            if resp.getheader("Content-Type") == SHARED_MEMORY_TYPE:
                descriptor = json.loads(resp.read())
                conn.close()
                try:
                    version, arrays = self._receive_shared(descriptor, shardings, like, out)
                except OSError as e:  # e.g. /proc/<pid>/fd not ours to open: TCP from now on
                    log.info("shared memory of %s unusable (%s); pulling over TCP", self.url, e)
                    self._local = ""
                    self._give_back(held)
                    held = None
                    return self._pull_once(path, asked, wait_s, shardings, like, out)
                how = "shared memory"
            elif resp.getheader("Content-Type") == DELTA_TYPE:
                if held is None:
                    raise WireError("the server sent a delta this client did not ask for")
                consumed = True
                version, arrays = self._receive_delta(Counting(resp), held, shardings, like)
                how = f"TCP (delta from version {held.manifest.version})"
            else:
                consumed = True
                version, arrays = self._receive(Counting(resp), shardings, like, out, held)
                how = "TCP"
            log.debug(
                "pulled version %s through %s in %.2fs", version, how, time.perf_counter() - t0
            )
            transport = how.split(" (", 1)[0]
            if transport != self._transport:  # said once, and again when it changes
                self._transport = transport
                log.info("pulling weights from %s by %s", self.url, transport)
        finally:
            conn.close()
            if not consumed:  # no body used it (no version yet, refused, shared memory)
                self._give_back(held)
        return version, arrays

    def _take_held(self) -> HeldVersion | None:
        """The held copy, now this pull's: a pull that fails leaves none (a delta may have
        rebuilt part of it), and a concurrent pull takes the whole version."""
        with self._held_lock:
            held, self._held = self._held, None
        return held

    def _give_back(self, held: HeldVersion | None) -> None:
        """A held copy taken by a pull that left it untouched, held again."""
        if held is not None:
            with self._held_lock:
                if self._held is None:
                    self._held = held

    def _keep(self, held: HeldVersion | None) -> None:
        """``held``, a verified version's host copy, as the base of the next pull."""
        with self._held_lock:
            self._held = held

    def _receive(
        self, resp: Counting, shardings: Any, like: Any, out: Any, held: HeldVersion | None
    ) -> tuple[int, Any]:
        """One wire stream into placed arrays: (version, params). With ``delta`` on (and no
        ``out``) its host copy is kept as the next pull's base."""
        keep = self.delta and out is None
        version, params, kept = read_stream(resp, shardings, like, out, held, keep)
        self._keep(kept)
        self.last_pull = PullStats(version, "tcp", None, resp.count, resp.count)
        return version, params

    def _receive_delta(
        self, resp: Counting, held: HeldVersion, shardings: Any, like: Any
    ) -> tuple[int, Any]:
        """A delta stream rebuilt on ``held`` into placed arrays: (version, params)."""
        version, params, kept, full = read_delta(resp, held, shardings, like)
        self._keep(kept)
        self.last_pull = PullStats(version, "tcp", held.manifest.version, resp.count, full)
        return version, params

    def _receive_shared(
        self, descriptor: dict, shardings: Any, like: Any, out: Any
    ) -> tuple[int, Any]:
        """A version copied out of the server's shared memory into placed arrays."""
        version, params, nbytes = read_shared(descriptor, self._segments, shardings, like, out)
        self.last_pull = PullStats(version, "shared memory", None, nbytes, nbytes)
        return version, params

    # ------------------------------------------------------------------ plumbing
    def _require_worker(self) -> str:
        if not self.worker_id:
            raise ValueError("this call needs a worker_id: ParameterServerClient(..., worker_id=)")
        return self.worker_id

    def _headers(self, part: tuple[int, int] | None = None) -> dict[str, str]:
        """Every request's headers: the bearer token, and ``_extra_headers``."""
        return self._http.headers(self._extra_headers(part))

    def _extra_headers(self, part: tuple[int, int] | None = None) -> dict[str, str]:
        """This worker's id (a heartbeat with every call) and a multi-host push's part."""
        headers = {}
        if self.worker_id:
            headers[WORKER_HEADER] = self.worker_id
        if part is not None:
            headers[PART_HEADER], headers[PARTS_HEADER] = str(part[0]), str(part[1])
        return headers

    @property
    def url(self) -> str:
        """The server's URL (or, before it published one, its service file)."""
        return str(self._endpoint)

    def _connection(self, timeout_s: float) -> http.client.HTTPConnection:
        return self._http.connection(timeout_s)  # NotPublishedError: a ConnectionError

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        """One small JSON request, retried on transport errors; the decoded JSON reply."""
        return self._http.call(method, path, body, headers=self._extra_headers())

    def _transfer_failed(self, error: Exception, attempt: int, what: str, last: bool) -> None:
        """After a push or pull broke off: ServerUnavailableError when it was the ``last``
        attempt, else a warning and the back-off after ``attempt`` before the next."""
        if last:
            raise ServerUnavailableError(f"{what} failed: {error!r}") from error
        log.warning("%s failed (%r); retrying", what, error)
        time.sleep(backoff_s(attempt, 0.2, 2.0))

    def _unavailable(self, error: Exception, what: str) -> Exception:
        return ServerUnavailableError(f"{what} on {self.url} failed: {error!r}")

    def _refusal(self, reply: Reply, what: str) -> Exception:
        """The error for a refused request: its status's class, the server's reason."""
        text = f"{what} on {self.url}: HTTP {reply.status}: {_error_message(reply.body)}"
        if reply.status in (401, 403):
            return AuthenticationError(text)
        if reply.status == 409:
            return VersionConflictError(text)
        if reply.status == 408:
            return PushAssemblyTimeoutError(text)
        return ParameterServerError(text)

    def _raise_for_status(self, status: int, body: bytes, what: str) -> None:
        if status >= 300:
            raise self._refusal(Reply(status, body), what)


def _early_reply(conn: http.client.HTTPConnection, timeout_s: float) -> tuple[int, bytes] | None:
    """(status, body) of a reply the server sent before it stopped reading the request (it
    refused the push early and closed), or None when there is none to read."""
    if conn.sock is None:
        return None
    try:
        conn.sock.settimeout(timeout_s)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except (*_TRANSPORT_ERRORS, http.client.HTTPException):
        return None


def _error_message(body: bytes) -> str:
    """The ``error`` of a JSON error reply (or the start of any other body)."""
    try:
        return json.loads(body).get("error", "")
    except (ValueError, AttributeError):
        return body[:200].decode(errors="replace")


def _assembly_timeout(reply: dict) -> float:
    """How long the server may hold a part's reply (its ``assembly_timeout_s``)."""
    value = reply.get("assembly_timeout_s")
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        return _ASSEMBLY_TIMEOUT_S
    return float(value)
