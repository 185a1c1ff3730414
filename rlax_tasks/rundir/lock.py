"""The run lock: one live run per run directory (docs/design.md §13), at
``run_paths(run_dir).lock``.

A second `rlax run` on a live run gets ``RunLocked`` (who holds it, what to do); a dead run's
lock is taken over. Locally an ``fcntl.flock`` (freed by the kernel when the holder dies); on
``gs://`` a renewed lease (``Lease``). Use ``with acquire(run_dir) as lock: ... lock.check()``."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

log = logging.getLogger(__name__)

DEFAULT_TTL_S = 60.0
# the longest a job waits for another holder's lease to run out (``for_job``): a lease and a
# renewal's slack, so that a preempted holder's lease has expired by then
JOB_WAIT_S = DEFAULT_TTL_S + 15.0
# how often a waiting ``acquire`` tries again
POLL_S = 2.0
# set by `rlax run` for the processes it starts: the id of the lock it holds for them
HOLDER_ENV = "RLAX_RUN_LOCK_HOLDER"


class RunLocked(RuntimeError):
    """The run directory is held by another live run (or this run lost its lease); ``holder``:
    who holds it, when known."""

    def __init__(self, message: str, holder: Holder | None = None) -> None:
        super().__init__(message)
        self.holder = holder


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a run's lock; ``expires`` (wall time) only for a lease, 0 = released."""

    id: str
    pid: int
    host: str
    started: float
    expires: float | None = None

    @classmethod
    def me(cls) -> Holder:
        return cls(uuid.uuid4().hex, os.getpid(), socket.gethostname(), time.time())

    def describe(self) -> str:
        """``pid 123 on host-a since 2026-01-31 12:00:00``."""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host} since {since}"

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def parse(cls, data: bytes | None) -> Holder | None:
        """The holder written in a lock file or lease; None when empty or unreadable."""
        try:
            raw: dict[str, Any] = json.loads(data or b"")
            return cls(
                str(raw["id"]), int(raw["pid"]), str(raw["host"]), float(raw["started"]),
                None if raw.get("expires") is None else float(raw["expires"]),
            )  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return None


def _refusal(run_dir: str, holder: Holder | None, extra: str = "") -> RunLocked:
    who = holder.describe() if holder is not None else "another process"
    stop = f" (kill {holder.pid} on {holder.host})" if holder is not None else ""
    return RunLocked(
        f"run {run_dir} is in use by {who}{extra}: wait for that run to end or stop it{stop}, "
        "then run this again (the same command resumes it)",
        holder,
    )


class FileLock:
    """The local run lock: an exclusive ``flock`` on run_dir/run.lock while the run lives."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir, self.path = run_dir, run_paths(run_dir).lock
        self.holder = Holder.me()
        self._file: Any = None

    def acquire(self) -> FileLock:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        f = open(self.path, "a+b")  # noqa: SIM115 - held open for the life of the run
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = Holder.parse(f.read())
            f.close()
            raise _refusal(self.run_dir, holder) from None
        f.seek(0)
        stale = Holder.parse(f.read())
        if stale is not None:
            log.warning(
                "%s: left by %s, which is no longer running: taken over", self.path,
                stale.describe(),
            )  # fmt: skip
        f.seek(0)
        f.truncate()
        f.write(self.holder.to_bytes())
        f.flush()
        self._file = f
        return self

    def check(self) -> None:
        """Nothing to lose: the kernel holds the lock until this process ends."""

    def release(self) -> None:
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()  # a clean end leaves no holder behind
        self._file.close()  # closing the last descriptor releases the flock
        self._file = None

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Lease:
    """A lease object (gs://, or any path ``storage.commit_pointer`` serves), renewed every
    ``ttl_s / 3`` in the background and taken over once past ``expires``. Expiry compares the
    holder's wall clock with the reader's: keep ``ttl_s`` well above the skew between hosts."""

    def __init__(
        self, run_dir: str, ttl_s: float = DEFAULT_TTL_S, renew_every_s: float | None = None
    ) -> None:
        self.run_dir, self.path = run_dir, run_paths(run_dir).lock
        self.ttl_s = ttl_s
        self.renew_every_s = renew_every_s if renew_every_s is not None else ttl_s / 3
        self.holder = Holder.me()
        self.generation = 0
        self.lost: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self, expires: float, generation: int) -> int:
        self.holder = dataclasses.replace(self.holder, expires=expires)
        return storage.commit_pointer(self.path, self.holder.to_bytes(), generation)

    def acquire(self) -> Lease:
        data, generation = storage.read_versioned(self.path)
        old = Holder.parse(data)
        now = time.time()
        if old is not None and old.id != self.holder.id and (old.expires or 0) > now:
            raise _refusal(self.run_dir, old, f" (its lease runs to {_clock(old.expires)})")
        if old is not None and old.expires:
            log.warning(
                "%s: the lease of %s expired at %s (that run stopped renewing it): taken over",
                self.path, old.describe(), _clock(old.expires),
            )  # fmt: skip
        try:
            self.generation = self._write(now + self.ttl_s, generation)
        except storage.PreconditionFailedError:  # another run took it between read and write
            raise _refusal(
                self.run_dir, Holder.parse(storage.read_versioned(self.path)[0])
            ) from None
        self._thread = threading.Thread(target=self._renew_loop, name="rlax-run-lease", daemon=True)
        self._thread.start()
        return self

    def renew(self) -> bool:
        """Extends the lease once; False (and ``lost`` set) when another holder has it now."""
        data, generation = storage.read_versioned(self.path)
        current = Holder.parse(data)
        if current is None or current.id != self.holder.id:
            who = current.describe() if current is not None else "nobody (it was removed)"
            self.lost = f"the lease {self.path} is now held by {who}"
            return False
        try:
            self.generation = self._write(time.time() + self.ttl_s, generation)
        except storage.PreconditionFailedError:  # changed between read and write: by whom?
            current = Holder.parse(storage.read_versioned(self.path)[0])
            if current is None or current.id != self.holder.id:
                self.lost = f"the lease {self.path} was taken over while being renewed"
                return False
        return True

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.renew_every_s):
            try:
                if not self.renew():
                    log.error("run %s: %s; this run must stop", self.run_dir, self.lost)
                    return
            except Exception as e:  # noqa: BLE001 - a storage hiccup: retry before it runs out
                log.warning("run %s: lease not renewed (%s); retrying", self.run_dir, e)

    def check(self) -> None:
        """Raises RunLocked when the lease was lost or ran out without a renewal."""
        if self.lost is None and (self.holder.expires or 0) < time.time():
            self.lost = f"the lease {self.path} ran out at {_clock(self.holder.expires)}"
        if self.lost is not None:
            raise RunLocked(
                f"run {self.run_dir} lost its lock: {self.lost}; stopping so that two runs do "
                "not write one run directory"
            )

    def release(self) -> None:
        """Stops renewing and marks the lease released (expires 0) when it is still ours."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        data, generation = storage.read_versioned(self.path)
        current = Holder.parse(data)
        if current is not None and current.id == self.holder.id:
            try:
                self._write(0.0, generation)
            except storage.PreconditionFailedError:
                log.warning("%s changed while being released; left as it is", self.path)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _clock(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t or 0))


def acquire(run_dir: str, ttl_s: float = DEFAULT_TTL_S, wait_s: float = 0.0) -> FileLock | Lease:
    """Takes the lock of ``run_dir`` (a local flock, or a gs:// lease); RunLocked when a live
    run holds it, after trying for up to ``wait_s`` (every ``POLL_S``). Use as a context
    manager, or call ``release()``."""
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            if storage.is_gcs(run_dir):
                return Lease(run_dir, ttl_s).acquire()
            return FileLock(run_dir).acquire()
        except RunLocked as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            if not waiting:
                waiting = True
                log.warning("%s; waiting up to %.0f s for it to end", e, left)
            time.sleep(min(POLL_S, left))


class InheritedLock:
    """The lock `rlax run` holds for the processes it starts (``for_job``): nothing to take,
    check or release in the process itself."""

    def __init__(self, run_dir: str, holder: Holder) -> None:
        self.run_dir, self.holder = run_dir, holder

    def check(self) -> None:
        """The holder, this process's `rlax run`, stops its processes before it ends."""

    def release(self) -> None:
        """Released by its holder."""

    def __enter__(self) -> InheritedLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def for_job(run_dir: str) -> FileLock | Lease | InheritedLock:
    """The lock of the job that decides for ``run_dir`` (the controller, a colocated run): the
    lock of the `rlax run` that started it (``HOLDER_ENV`` names its holder), else its own, taken
    as ``acquire`` does, waiting up to ``JOB_WAIT_S`` for a gs:// lease to run out (a job restarted
    after preemption finds the dead one's). RunLocked names the live run that holds it."""
    inherited = os.environ.get(HOLDER_ENV)
    wait_s = JOB_WAIT_S if storage.is_gcs(run_dir) and not inherited else 0.0
    try:
        return acquire(run_dir, wait_s=wait_s)
    except RunLocked as e:
        if inherited and e.holder is not None and e.holder.id == inherited:
            log.info("run %s: locked by the rlax run that started this job", run_dir)
            return InheritedLock(run_dir, e.holder)
        raise


def holder_env(lock: FileLock | Lease) -> dict[str, str]:
    """The environment of the processes a lock's holder starts: ``for_job`` finds it there."""
    return {HOLDER_ENV: lock.holder.id}


__all__ = [
    "FileLock",
    "Holder",
    "InheritedLock",
    "Lease",
    "RunLocked",
    "acquire",
    "for_job",
    "holder_env",
]
