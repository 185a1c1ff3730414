"""A pool of worker processes with a hard wall-clock timeout per call.

An overrunning call is answered "timeout" and its worker SIGKILLed and replaced; a crashed worker
is answered "error" and replaced. The caller uses no signals or alarms, so any number of threads
may share the pool."""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

# Workers die with the *thread* that started them (PR_SET_PDEATHSIG follows the parent thread),
# so a pool made or refilled on a short-lived thread (an environment step's) lost its workers
# when that thread ended. Every worker is started from this one thread, which lives as long as
# the process.
_STARTER = ThreadPoolExecutor(1, thread_name_prefix="rlax-pool-starter")


@dataclass(frozen=True)
class CallOutcome:
    """Result of one pooled call: status is "ok", "timeout" or "error"."""

    status: str
    value: Any = None
    error: str = ""
    wall_s: float = 0.0


def _worker_main(fd: int) -> None:
    """Worker loop: receive the set-up, then run (fn, args) requests until the socket closes."""
    try:  # die with the parent even while stuck in C code
        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    conn = Connection(fd)
    initializer, memory_mb, parent_pid = conn.recv()
    if os.getppid() != parent_pid:
        return
    if memory_mb:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        if initializer is not None:
            initializer()
        conn.send(("ready", None))
    except BaseException:  # noqa: BLE001 - report any start-up failure to the parent
        conn.send(("init_error", traceback.format_exc()))
        return
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = ("ok", fn(*args))
        except BaseException as exc:  # noqa: BLE001 - every failure is reported as a verdict
            result = ("error", f"{type(exc).__name__}: {exc}"[:2000])
        try:
            conn.send(result)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
            conn.send(("error", f"cannot send result: {exc}"[:2000]))


class _Worker:
    """One worker process (`python -m rlax_tasks.rewards.pool`) and its private socket."""

    def __init__(self, initializer: Callable[[], None] | None, memory_mb: int | None) -> None:
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        try:
            self.process = _STARTER.submit(
                subprocess.Popen,
                [sys.executable, "-m", "rlax_tasks.rewards.pool", str(child_sock.fileno())],
                pass_fds=(child_sock.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
                close_fds=True,
            ).result()
        finally:
            child_sock.close()
        self.conn = Connection(parent_sock.detach())
        self.conn.send((initializer, memory_mb, os.getpid()))
        self.ready = False

    def wait_ready(self, timeout_s: float) -> None:
        if self.ready:
            return
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"verifier worker did not start within {timeout_s:.0f}s")
        kind, detail = self.conn.recv()
        if kind != "ready":
            raise RuntimeError(f"verifier worker failed to start:\n{detail}")
        self.ready = True

    def kill(self) -> None:
        try:
            self.process.kill()
            self.process.wait(timeout=5)
        finally:
            self.conn.close()


class IsolatedPool:
    """Fixed-size pool of spawned processes; `call` never blocks longer than its timeout
    plus the wait for a free worker."""

    def __init__(
        self,
        size: int,
        initializer: Callable[[], None] | None = None,
        *,
        memory_mb: int | None = None,
        start_timeout_s: float = 120.0,
    ) -> None:
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self.size = size
        self._initializer = initializer
        self._memory_mb = memory_mb
        self._start_timeout_s = start_timeout_s
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        self.replaced = 0
        self._started: list[int] = []
        for _ in range(size):
            self._idle.put(self._spawn())

    def _spawn(self) -> _Worker:
        worker = _Worker(self._initializer, self._memory_mb)
        self._started.append(worker.process.pid)
        return worker

    def call(self, fn: Callable[..., Any], args: tuple = (), timeout_s: float = 5.0) -> CallOutcome:
        """Run fn(*args) in a worker; kill the worker if it takes more than timeout_s."""
        if self._closed:
            raise RuntimeError("pool is closed")
        worker: _Worker | None = self._idle.get()
        try:
            worker.wait_ready(self._start_timeout_s)
        except (EOFError, OSError, RuntimeError) as exc:
            self._replace(worker, "failed to start")
            raise RuntimeError(f"verifier worker failed to start: {exc}") from exc
        start = time.monotonic()
        try:
            worker.conn.send((fn, args))
            if not worker.conn.poll(timeout_s):
                self._replace(worker, "timed out")
                worker = None
                return CallOutcome(
                    "timeout", error=f"exceeded {timeout_s}s", wall_s=time.monotonic() - start
                )
            status, value = worker.conn.recv()
        except (EOFError, OSError) as exc:
            self._replace(worker, f"crashed ({exc!r})")
            worker = None
            return CallOutcome(
                "error", error=f"worker died: {exc!r}", wall_s=time.monotonic() - start
            )
        finally:
            if worker is not None:
                self._release(worker)
        wall = time.monotonic() - start
        if status == "ok":
            return CallOutcome("ok", value=value, wall_s=wall)
        return CallOutcome("error", error=str(value), wall_s=wall)

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            if not self._closed:
                self._idle.put(worker)
                return
        worker.kill()

    def _replace(self, worker: _Worker, why: str) -> None:
        logger.warning("verifier worker pid=%s %s; replacing it", worker.process.pid, why)
        worker.kill()
        with self._lock:
            self.replaced += 1
            if self._closed:
                return
        self._idle.put(self._spawn())

    def pids(self) -> list[int]:
        """Pids of the currently idle workers (for tests and monitoring)."""
        with self._idle.mutex:
            return [w.process.pid for w in self._idle.queue]

    def all_pids(self) -> list[int]:
        """Pids of every live worker process started by this pool (idle or busy)."""
        with self._lock:
            return [pid for pid in self._started if _alive(pid)]

    def close(self) -> None:
        """Kill all workers; calls in flight finish with an error."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._pid:
            return
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                break

    def __enter__(self) -> IsolatedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


if __name__ == "__main__":
    _worker_main(int(sys.argv[1]))
