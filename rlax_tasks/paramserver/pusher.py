"""A push: a version's blocks streamed from the trainer's memory to the server in one PUT.

Room first (``reserve``, long polls until ``push_wait_s``), then the wire stream, each block's
CRC32C computed over the bytes about to go out; a multi-host trainer's hosts push one part each
and all return once the version is decided (docs/design.md §6)."""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.parse
from typing import Any

from rlax_tasks.paramserver.errors import PushTimeoutError, VersionConflictError
from rlax_tasks.paramserver.naming import flatten_named
from rlax_tasks.paramserver.push_plan import PlannedBlock, plan_leaf, push_part
from rlax_tasks.paramserver.transport import Part, Transport, early_reply, error_message
from rlax_tasks.paramserver.wire import (
    END_FRAME_SIZE,
    BlockHeader,
    Manifest,
    block_header_size,
    crc32c,
    end_frame,
    version_digest,
)
from rlax_tasks.services.http import TRANSPORT_ERRORS

log = logging.getLogger(__name__)

_RESERVE_POLL_S = 30.0  # longest one reserve request may be held (a stalled server: no hang)
_ASSEMBLY_TIMEOUT_S = 600.0  # the server's default, if its reserve reply does not say


class Pusher:
    """Pushes versions through ``transport``: blocks of at most ``chunk_bytes``, waiting up to
    ``push_wait_s`` for room on the server."""

    def __init__(self, transport: Transport, chunk_bytes: int, push_wait_s: float) -> None:
        self.transport, self.chunk_bytes, self.push_wait_s = transport, chunk_bytes, push_wait_s

    def push(self, version: int, params: Any) -> None:
        """``ParameterServerClient.push``: ``params`` as ``version``, visible on return; the
        reservation, the stream and its retries (a retry that finds its own digest committed
        is done)."""
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
        for attempt in range(self.transport.retries + 1):
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
            except TRANSPORT_ERRORS as e:
                where = f"push of {what} to {self.transport.url}"
                self.transport.transfer_failed(e, attempt, where, attempt >= self.transport.retries)
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
        part: Part = None,
        hold_s: float = 0.0,
    ) -> None:
        what = f"push of version {manifest.version}"
        if part is not None:
            what += f" (part {part[0]} of {part[1]})"
        conn = self.transport.connection(self.transport.timeout_s)
        try:
            try:
                self._send_stream(conn, manifest, plan, length, digests, part)
            except TRANSPORT_ERRORS:
                early = early_reply(conn, min(self.transport.timeout_s, 5.0))
                if early is None or early[0] < 300:
                    raise
                self.transport.raise_for_status(*early, what)  # refused before the end: say why
            if part is not None:  # the reply waits until every host's part is in
                conn.sock.settimeout(self.transport.timeout_s + hold_s)
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        self.transport.raise_for_status(resp.status, body, what)

    def _send_stream(
        self,
        conn: http.client.HTTPConnection,
        manifest: Manifest,
        plan: list[PlannedBlock],
        length: int,
        digests: list[bytes],
        part: Part,
    ) -> None:
        """The PUT's headers and wire stream: each block's CRC32C is computed over the bytes
        about to be sent (the trainer's memory, or the block's host copy), then header and bytes
        go out; the end frame carries the digest (also appended to ``digests``)."""
        conn.putrequest("PUT", f"/v1/versions/{manifest.version}", skip_accept_encoding=True)
        for key, value in self.transport.headers(part).items():
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

    def _reserve(self, version: int, nbytes: int, deadline: float, part: Part = None) -> dict:
        """Room for ``nbytes`` of ``version`` on the server, waiting (long polls) until deadline;
        the server's reply. The parts of a multi-host version share one reservation.

        Also fails fast on a bad token or a stale version number, before any block is sent.
        """
        path, waited = f"/v1/versions/{version}/reserve", False
        while True:
            left = min(max(deadline - time.monotonic(), 0.0), _RESERVE_POLL_S)
            query = urllib.parse.urlencode({"wait_s": f"{left:.3f}"})
            answer = self.transport.json.send(
                "POST",
                f"{path}?{query}",
                {"nbytes": int(nbytes)},
                timeout_s=self.transport.timeout_s + left,
                headers=self.transport.extra_headers(part),
            )
            status, raw = answer.status, answer.body
            if status != 503:
                self.transport.raise_for_status(status, raw, f"push of version {version}")
                if waited:
                    log.info("version %d has room on %s now: pushing", version, self.transport.url)
                try:
                    reply = json.loads(raw)
                except ValueError:
                    reply = None
                return reply if isinstance(reply, dict) else {}
            message = error_message(raw)
            if time.monotonic() >= deadline:
                raise PushTimeoutError(
                    f"push of version {version} to {self.transport.url}: no room within "
                    f"push_wait_s={self.push_wait_s:g}s: {message}"
                )
            if not waited:
                log.warning(
                    "push of version %d waits on %s: %s", version, self.transport.url, message
                )
                waited = True
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0.0)))

    def _committed_earlier(self, version: int, digest: bytes, part: Part) -> bool:
        """Whether the newest version is ``version`` as pushed with ``digest`` (of this part's
        blocks, for a part of a multi-host version)."""
        latest = self.transport.call("GET", "/v1/latest")
        if latest.get("version") != version:
            return False
        if part is None:
            return latest.get("digest") == digest.hex()
        parts = latest.get("parts") or []
        return len(parts) == part[1] and parts[part[0]] == digest.hex()


def _assembly_timeout(reply: dict) -> float:
    """How long the server may hold a part's reply (its ``assembly_timeout_s``)."""
    value = reply.get("assembly_timeout_s")
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        return _ASSEMBLY_TIMEOUT_S
    return float(value)
