"""Every worker's finished groups, long-polled from one event loop (``HttpWorkerPool``).

Asking each worker holding work for its results at every round costs the controller a request
per worker per round, most answered "nothing yet", and in CPython that client CPU is the cost:
threads asking at once share one interpreter. A thread per worker waiting in a long poll costs
nothing idle, but a thousand of them waking together starve the controller's own thread. So one
event loop, on a thread of its own, keeps a long poll open at every worker
(``GET /v1/results?wait_s``) and keeps what comes back until the controller takes it: requests
follow the results, not the rounds, and the controller's rounds ask no worker anything. A
snapshot's question to every worker holding work (its progress) goes out on the same loop, all
at once (``get_many``), not from a pool of threads sharing the interpreter."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import random
import threading
import time
from typing import Any

from rlax_tasks.controller.ports import WORKER_ERRORS, LateAnswer
from rlax_tasks.services.http import backoff_s

log = logging.getLogger(__name__)

WAIT_S = 20.0  # one long poll at a worker (it answers at once when results are ready)
RETRY_S = (0.25, 5.0)  # after a failed poll: the first wait, doubled up to the second
MAX_HEADER_LINES = 100
ASK_AT_ONCE = 256  # requests of one ``get_many`` open at a time


class _Feed:
    """One worker's results waiting to be taken, and its last poll's failure."""

    def __init__(self, worker_id: str, client: Any) -> None:
        self.worker_id, self.client = worker_id, client
        self.lock = threading.Lock()
        self.ready: list[dict[str, Any]] = []
        self.error: Exception | None = None
        self.dropped = 0  # results that came back for a reset or departed worker
        self.retired = False
        self.future: concurrent.futures.Future | None = None


class ResultFeeds:
    """Long polls at every worker ``add``-ed, on one event loop; thread-safe. ``take`` hands
    over what came back; the last poll's failure is kept until a poll or a submission
    (``answered``) succeeds, and ``take`` raises it when nothing is waiting."""

    def __init__(self, wait_s: float = WAIT_S) -> None:
        self.wait_s = wait_s
        self._feeds: dict[str, _Feed] = {}
        self._retired: list[_Feed] = []
        self._stopping = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="rlax-result-feeds", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ the controller's side
    def add(self, worker_id: str, client: Any) -> None:
        """Starts polling ``client`` (a ``WorkerClient``), in place of any earlier one."""
        self.remove(worker_id)
        feed = self._feeds[worker_id] = _Feed(worker_id, client)
        feed.future = asyncio.run_coroutine_threadsafe(self._run(feed), self._loop)

    def remove(self, worker_id: str) -> None:
        """Stops polling a worker that left; what it brought back is dropped (counted)."""
        feed = self._feeds.pop(worker_id, None)
        if feed is None:
            return
        with feed.lock:
            feed.retired = True
            feed.dropped += len(feed.ready)
            feed.ready = []
        if feed.future is not None:
            feed.future.cancel()
        self._retired.append(feed)

    def take(self, worker_id: str) -> list[dict[str, Any]]:
        """What came back from the worker since the last call (JSON, as it sent it); raises
        its last poll's failure when nothing did."""
        feed = self._feeds[worker_id]
        with feed.lock:
            if not feed.ready and feed.error is not None:
                raise feed.error
            out, feed.ready = feed.ready, []
        return out

    def answered(self, worker_id: str) -> None:
        """The worker answered another call (a submission): it is up."""
        feed = self._feeds.get(worker_id)
        if feed is not None:
            with feed.lock:
                feed.error = None

    def reset(self, worker_id: str) -> None:
        """The worker dropped all its work: so does its feed (counted)."""
        feed = self._feeds.get(worker_id)
        if feed is not None:
            with feed.lock:
                feed.dropped += len(feed.ready)
                feed.ready = []

    @property
    def dropped(self) -> int:
        """Results that came back and were dropped with a reset or a departed worker."""
        return sum(f.dropped for f in [*self._feeds.values(), *self._retired])

    def close(self, wait_s: float = 0.0) -> int:
        """Stops polling: waits up to ``wait_s`` for the polls under way to end, cuts the rest;
        returns the results that came back and were never taken."""
        self._stopping = True
        futures = [f.future for f in self._feeds.values() if f.future is not None]
        if futures and wait_s > 0:
            concurrent.futures.wait(futures, timeout=wait_s)
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop).result(5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        return sum(len(f.ready) for f in self._feeds.values())

    async def _cancel_all(self) -> None:
        """Cancels every poll still under way, and waits until they are gone."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ the loop's side
    async def _run(self, feed: _Feed) -> None:
        failures = 0
        while not self._stopping:
            try:
                got = await self._poll(feed.client)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # WORKER_ERRORS; a refused token is kept the same way
                if not isinstance(e, WORKER_ERRORS):
                    log.warning("results of worker %s: %r", feed.worker_id, e)
                with feed.lock:
                    feed.error = e
                await asyncio.sleep(backoff_s(failures, *RETRY_S))
                failures += 1
                continue
            failures = 0
            with feed.lock:
                feed.error = None
                if feed.retired:
                    feed.dropped += len(got)
                else:
                    feed.ready.extend(got)

    async def _poll(self, client: Any) -> list[dict[str, Any]]:
        """One ``GET /v1/results`` long poll, as ``WorkerClient.results`` asks it."""
        # each poll's wait drawn anew: a fleet's polls, started together, end apart
        wait_s = self.wait_s * random.uniform(0.5, 1.0)
        path = client.results_path(wait_s)
        status, body = await self._get(client, path, client.timeout_s + wait_s, "results poll")
        return client.results_answer(status, body)

    async def _get(
        self, client: Any, path: str, timeout_s: float, what: str
    ) -> tuple[int, bytes]:
        """(status, body) of one ``GET path`` at ``client``'s worker, with its token;
        ConnectionError when it cannot be reached or its answer cannot be read."""
        endpoint = client.endpoint
        if endpoint.fixed:
            host, port = endpoint.host_port()
        else:  # a service file, read now and then (local or gs://): not on the loop
            host, port = await self._loop.run_in_executor(None, endpoint.host_port)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), client.timeout_s
            )
        except (OSError, TimeoutError) as e:
            raise ConnectionError(f"worker {client.url} unreachable: {e!r}") from e
        try:
            headers = "".join(f"{k}: {v}\r\n" for k, v in client.http.headers().items())
            request = f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{headers}"
            writer.write((request + "Connection: close\r\n\r\n").encode("latin-1"))
            limit = client.http.max_reply_bytes
            return await asyncio.wait_for(_read_reply(reader, limit), timeout_s)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            raise ConnectionError(f"worker {client.url}: {what} failed: {e!r}") from e
        finally:
            writer.close()

    # ------------------------------------------------------------------ one request to many
    def get_many(
        self,
        calls: dict[str, tuple[Any, str, float]],
        at_once: int = ASK_AT_ONCE,
        deadline_s: float | None = None,
    ) -> dict[str, tuple[int, bytes] | Exception]:
        """Per worker id, ``(client, path, timeout_s)`` asked on the loop, ``at_once`` at a
        time: its (status, body), or the ConnectionError it met, or ``LateAnswer`` when it had
        not answered within ``deadline_s`` of the call (None: no deadline)."""

        async def ask_all() -> list[tuple[int, bytes] | BaseException]:
            gate = asyncio.Semaphore(at_once)

            async def ask(client: Any, path: str, timeout_s: float) -> tuple[int, bytes]:
                async with gate:
                    return await self._get(client, path, timeout_s, f"GET {path}")

            tasks = [asyncio.ensure_future(ask(*call)) for call in calls.values()]
            # the deadline counts from the call, not from when the busy loop got to it
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            _, late = await asyncio.wait(tasks, timeout=left)
            for task in late:
                task.cancel()
            answers = await asyncio.gather(*tasks, return_exceptions=True)
            return [
                LateAnswer(f"no answer within {deadline_s} s") if task in late else answer
                for task, answer in zip(tasks, answers, strict=True)
            ]

        if not calls:
            return {}
        deadline = None if deadline_s is None else time.monotonic() + deadline_s
        answers = asyncio.run_coroutine_threadsafe(ask_all(), self._loop).result()
        out: dict[str, tuple[int, bytes] | Exception] = {}
        for worker_id, answer in zip(calls, answers, strict=True):
            if isinstance(answer, BaseException) and not isinstance(answer, Exception):
                raise answer  # (cancelled: the feeds are closing)
            out[worker_id] = answer
        return out


async def read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
    """The header lines of an HTTP message up to its blank line, keys lower-cased (at most
    ``MAX_HEADER_LINES``)."""
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADER_LINES):
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        key, _, value = line.decode("latin-1").partition(":")
        headers[key.strip().lower()] = value.strip()
    return headers


async def _read_reply(reader: asyncio.StreamReader, limit: int | None) -> tuple[int, bytes]:
    """(status, body) of an HTTP/1.1 reply (``Content-Length``, chunked, or to the end);
    ValueError for a malformed one or a body over ``limit`` bytes."""
    status_line = await reader.readline()
    parts = status_line.split(None, 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/"):
        raise ValueError(f"not an HTTP reply: {status_line[:80]!r}")
    status = int(parts[1])
    headers = await read_headers(reader)
    limit = limit or 1 << 62
    if "content-length" in headers:
        length = int(headers["content-length"])
        if length > limit:
            raise ValueError(f"a reply of {length} bytes, over the limit of {limit}")
        return status, await reader.readexactly(length)
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readline()
                return status, bytes(body)
            body += await reader.readexactly(size)
            await reader.readline()
            if len(body) > limit:
                raise ValueError(f"a reply over the limit of {limit} bytes")
    body = bytearray()
    while chunk := await reader.read(1 << 16):  # to the end: the connection closes
        body += chunk
        if len(body) > limit:
            raise ValueError(f"a reply over the limit of {limit} bytes")
    return status, bytes(body)
