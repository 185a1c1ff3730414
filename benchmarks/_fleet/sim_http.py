"""A small HTTP/1.1 server on asyncio streams: one per simulated worker port, a few hundred per
process. Just what ``JsonClient`` sends (a request line, headers, a ``Content-Length`` body,
keep-alive or not) and JSON replies; no framework, so a process hosts many endpoints cheaply and
the simulation can cut one off at once (``close``: a preempted host)."""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from rlax_tasks.controller.result_feeds import read_headers

log = logging.getLogger(__name__)

# (method, path, query, headers, body) -> (status, JSON-able reply)
Handler = Callable[[str, str, dict[str, str], dict[str, str], bytes], Awaitable[tuple[int, Any]]]
REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
           413: "Payload Too Large", 422: "Unprocessable Entity", 500: "Internal Server Error",
           503: "Service Unavailable"}  # fmt: skip
MAX_BODY_BYTES = 16 << 20


class Endpoint:
    """One listening port answering requests with ``handler``. A reply counts as sent once its
    bytes are all in the kernel (no write buffer here), and ``close`` ends connections with a
    FIN: what was sent still arrives, so the two sides' counts of handed-over groups agree."""

    def __init__(self, handler: Handler, sent: Callable[[Any, bool], None] | None = None) -> None:
        """``sent(reply, written)``: called once a reply's bytes are all written out (True) or
        its connection failed first (False)."""
        self.handler, self.sent = handler, sent
        self.server: asyncio.Server | None = None
        self.url = ""
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, host: str = "127.0.0.1") -> str:
        self.server = await asyncio.start_server(self._serve, host, 0, backlog=128)
        port = self.server.sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"
        return self.url

    def close(self) -> None:
        """Stops listening and closes every open connection (a host that went away)."""
        if self.server is not None:
            self.server.close()
        for w in list(self._writers):
            w.transport.close()
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        writer.transport.set_write_buffer_limits(high=0)  # drain(): every byte in the kernel
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                method, target, headers, body = request
                url = urllib.parse.urlsplit(target)
                query = dict(urllib.parse.parse_qsl(url.query))
                try:
                    status, reply = await self.handler(method, url.path, query, headers, body)
                except Exception as e:  # a bug in the simulated worker: answered, logged
                    log.exception("simulated endpoint failed on %s %s", method, url.path)
                    status, reply = 500, {"detail": repr(e)}
                data = json.dumps(reply).encode()
                head = (
                    f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                )
                try:
                    if writer.transport.is_closing():  # the endpoint was closed meanwhile
                        raise ConnectionError("closed")
                    writer.write(head.encode() + data)
                    await writer.drain()
                except (ConnectionError, RuntimeError):  # (uvloop: a closed transport)
                    if self.sent is not None:
                        self.sent(reply, False)
                    return
                if self.sent is not None:
                    self.sent(reply, True)
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            self._writers.discard(writer)
            writer.close()


async def _read_request(
    reader: asyncio.StreamReader,
) -> tuple[str, str, dict[str, str], bytes] | None:
    """(method, target, lower-cased headers, body) of the next request; None at EOF."""
    line = await reader.readline()
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers = await read_headers(reader)
    length = int(headers.get("content-length", "0") or 0)
    if length > MAX_BODY_BYTES:
        raise ValueError(f"body of {length} bytes")
    body = await reader.readexactly(length) if length else b""
    return method, target, headers, body
