"""What the service tests share: a FastAPI app served on 127.0.0.1 in a thread, raw HTTP
requests (any headers, any body), and JAX-free stand-ins for what the trainer and worker apps
wrap, so the real apps are tested without compiling a model."""

from __future__ import annotations

import contextlib
import http.client
import threading
import time
import urllib.parse
from collections.abc import Iterator
from typing import Any

from rlax_tasks.services.endpoints import listen
from tests.compute.helpers import wait_for

TOKEN = "s3cret-run-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Served(str):
    """The URL of an app ``served`` here, with a view of the server behind it."""

    server: Any

    def open_requests(self) -> int:
        """Requests the server is answering now (received, not yet answered)."""
        return len(self.server.server_state.tasks)


@contextlib.contextmanager
def served(app: Any, graceful_s: float = 1.0) -> Iterator[Served]:
    """``app`` under uvicorn on a free port of 127.0.0.1; yields its URL, stops it after."""
    import uvicorn

    sock, url = listen("127.0.0.1", 0)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=graceful_s)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout_s=30)
        out = Served(url)
        out.server = server
        yield out
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def request(
    url: str,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 10.0,
) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers) of one request sent as given: ``headers`` may claim any
    Content-Length, whatever ``body`` holds."""
    parsed = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout_s)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for key, value in (headers or {}).items():
            conn.putheader(key, value)
        if body is not None and "Content-Length" not in (headers or {}):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, resp.read(), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def timed(fn: Any) -> tuple[Any, float]:
    """(fn(), seconds it took)."""
    t0 = time.monotonic()
    out = fn()
    return out, time.monotonic() - t0


class IdleWorker:
    """The surface of ``InferenceWorker`` the worker app uses, generating nothing: ``results``
    blocks up to ``wait_s`` for a result (as the real one does) and gets one only when the
    test ``finish``es a submitted group."""

    version = 0

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.queued: list[Any] = []
        self.ready: list[Any] = []

    def submit(self, groups: list[Any]) -> None:
        with self.lock:
            self.queued.extend(groups)

    def results(self, wait_s: float = 0.0, max_groups: int | None = None) -> list[Any]:
        deadline = time.monotonic() + wait_s
        with self.lock:
            while not self.ready and (left := deadline - time.monotonic()) > 0:
                self.lock.wait(left)
            n = len(self.ready) if max_groups is None else min(max_groups, len(self.ready))
            out, self.ready = self.ready[:n], self.ready[n:]
            return out

    def reset(self) -> int:
        with self.lock:
            dropped = len(self.queued) + len(self.ready)
            self.queued, self.ready = [], []
            return dropped

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {"version": self.version, "queued": len(self.queued), "ready": len(self.ready)}


class CountingTrainer:
    """The surface of ``Trainer`` that ``TrainerService`` uses without a parameter server: a
    step counter and the batches it applied."""

    run_dir = "unused"

    def __init__(self) -> None:
        self.step_count = self.saved_step = 0
        self.batches: list[dict] = []

    def restore_latest(self) -> bool:
        return False

    def step(self, arrays: dict, extra_metrics: dict | None = None) -> dict:
        self.batches.append(arrays)
        self.step_count += 1
        return {"loss": 0.5, **(extra_metrics or {})}

    def save(self) -> None:
        self.saved_step = self.step_count

    def close(self) -> None:
        pass
