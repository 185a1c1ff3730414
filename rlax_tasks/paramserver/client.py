"""``ParameterServerClient``: push weights (trainer) and pull them (workers) over HTTP.

Both sides stream block by block (``pusher`` sends a push's blocks from the device shards,
``receive`` checks a pull's blocks into host arrays, ``placement`` puts those onto devices): each
holds one copy of the weights plus a chunk. A worker pulling over TCP also keeps a host copy of
the version it holds, so the next pull brings only what changed (``delta``). Every call has
timeouts (``transport``): a dead server hangs none (docs/design.md §6)."""

from __future__ import annotations

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
    CorruptedWeightsError,
    ParameterServerError,
    PullTimeoutError,
    VersionConflictError,
)
from rlax_tasks.paramserver.protocol import DELTA_TYPE, SHARED_MEMORY_TYPE
from rlax_tasks.paramserver.pusher import Pusher
from rlax_tasks.paramserver.receive import (
    Counting,
    HeldVersion,
    PullStats,
    check_out_alone,
    read_delta,
    read_shared,
    read_stream,
)
from rlax_tasks.paramserver.transport import Transport
from rlax_tasks.paramserver.wire import DEFAULT_CHUNK_BYTES, ChecksumError, WireError
from rlax_tasks.services.http import MAX_WAIT_S, TOKEN_ENV, TRANSPORT_ERRORS

# raised by push (a 409), importable from here as before
__all__ = ["ParameterServerClient", "VersionConflictError"]

log = logging.getLogger(__name__)


def heartbeats(beat: Any, interval_s: float, where: str) -> threading.Event:
    """Calls ``beat()`` every ``interval_s`` on a daemon thread until the returned event is set;
    a failed beat is a warning (the server forgets the worker only after its timeout)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(interval_s):
            try:
                beat()
            except ParameterServerError as e:
                log.warning("heartbeat %s failed: %s", where, e)

    threading.Thread(target=loop, name="ps-heartbeat", daemon=True).start()
    return stop


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
        self.timeout_s, self.retries = timeout_s, retries
        self._transport = Transport(url, token, worker_id, timeout_s, retries)
        self._endpoint = self._transport.endpoint  # a URL or the service file the PS publishes
        self._pusher = Pusher(self._transport, chunk_bytes, push_wait_s)
        self._local = shm.host_identity() if shared_memory else ""
        self._pulled_by = ""  # how the last pull came: "shared memory" or "TCP"
        self._segments = shm.SegmentReader()  # the server's segments, mapped between pulls
        self.delta = delta
        self._held: HeldVersion | None = None  # taken by a pull while it rebuilds or replaces it
        self._held_lock = threading.Lock()
        self.last_pull: PullStats | None = None
        self._heartbeat_stop: threading.Event | None = None

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
        if self._heartbeat_stop is None:
            self._heartbeat_stop = heartbeats(self.heartbeat, interval_s, f"to {self.url}")

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
        self._pusher.push(version, params)

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
            except TRANSPORT_ERRORS as e:
                failures += 1
                last = failures > self.retries or time.monotonic() >= deadline
                self._transport.transfer_failed(e, failures - 1, f"pull from {self.url}", last)
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
            except TRANSPORT_ERRORS as e:
                what = f"pull of version {version} from {self.url}"
                self._transport.transfer_failed(e, attempt, what, attempt >= self.retries)
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
        conn = self._transport.connection(self.timeout_s + wait_s)
        consumed = False  # whether this pull rebuilt or replaced the held copy
        try:
            conn.request("GET", target, headers=self._transport.headers())
            resp = conn.getresponse()
            if resp.status == 204:
                resp.read()
                return None
            if resp.status != 200:
                self._transport.raise_for_status(resp.status, resp.read(), f"GET {path}")
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
            pulled_by = how.split(" (", 1)[0]
            if pulled_by != self._pulled_by:  # said once, and again when it changes
                self._pulled_by = pulled_by
                log.info("pulling weights from %s by %s", self.url, pulled_by)
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

    def hand_over_base(self, other: ParameterServerClient) -> None:
        """Gives the host copy of the version this client holds (the base of a delta pull) to
        ``other``, a client of another replica: its next pull may still be a delta."""
        other._keep(self._take_held())

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

    @property
    def url(self) -> str:
        """The server's URL (or, before it published one, its service file)."""
        return self._transport.url

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        """One small JSON request, retried on transport errors; the decoded JSON reply."""
        return self._transport.call(method, path, body)
