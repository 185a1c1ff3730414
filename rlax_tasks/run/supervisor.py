"""A small process supervisor: starts `rlax` components (each in its own process group, its
output in ``<log_dir>/<name>.log``, on ports kept across restarts), restarts the ones that die,
and owns them (docs/design.md §13): they die with it (a parent-death signal covers a ``kill -9``;
``stop`` and ``stop_on_signals`` the normal exit). A user error (exit 2) or the same failure
twice without progress raises ``ComponentFailed``; a signal kill or a transient error restarts."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from rlax_tasks.process.host_malloc import with_huge_pages
from rlax_tasks.process.parent_death import dies_with_parent

log = logging.getLogger(__name__)

JOB_NAME_ENV = "RLAX_JOB_NAME"  # rlax_tasks.rundir.notices reads it as a notice's source
# the last error line of a component's log: an `rlax <cmd>: error: ...` line (a user error) or
# the last line of a Python traceback
_CLI_ERROR = re.compile(r"^rlax [\w .-]*: error: ")
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Failed|Interrupt)\b")
_TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:,.]+\s+")
# failures that depend on another component's timing (a peer restarting, still starting, or
# not published yet), never "the same failure" as a reason to stop
_TRANSIENT = re.compile(
    r"connection refused|connect(ion)?error|connection reset|remote ?disconnected|"
    r"remoteprotocolerror|readerror|timed? ?out|deadline exceeded|unavailable|not published|"
    r"name resolution|\b50[234]\b|broken pipe",
    re.IGNORECASE,
)
_TAIL_BYTES = 65536


class ComponentFailed(RuntimeError):
    """A component failed in a way restarting will not fix; the message is one line for the
    terminal: the component, its own error and its log's path."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class Interrupted(KeyboardInterrupt):
    """`rlax run` was asked to stop by a signal (SIGTERM, SIGINT, SIGHUP)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclasses.dataclass
class Component:
    """One supervised process: ``argv`` after ``rlax``; ``restart`` unless it may finish.
    ``command`` replaces ``python -m rlax_tasks.cli`` (a program that is not an rlax command)."""

    name: str
    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    restart: bool = True
    # components of one group (the hosts of a multi-host trainer) live and die together: when
    # one dies the others are killed, and all restart
    group: str | None = None
    command: list[str] | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    log_offset: int = 0  # where this start's output begins in its log
    # (last error line, progress) of its previous failure since a success or a signal kill
    last_failure: tuple[str, Any] | None = None
    # stopped by ``Supervisor.stop``: not restarted until it is added again
    stopped: bool = False


class Supervisor:
    """Starts components, restarts dead ones (with a short back-off), stops them all at exit.

    ``progress`` (optional) returns how far the run is (`rlax run`: the last trained step); a
    component failing twice with the same error and the same progress stops the run.
    """

    def __init__(
        self,
        log_dir: str,
        backoff_s: float = 1.0,
        max_restarts: int = 50,
        progress: Callable[[], Any] | None = None,
    ) -> None:
        self.log_dir, self.backoff_s, self.max_restarts = log_dir, backoff_s, max_restarts
        self.progress = progress
        self.components: dict[str, Component] = {}
        os.makedirs(log_dir, exist_ok=True)

    def log_path(self, name: str) -> str:
        """The log file of component ``name``."""
        return os.path.join(self.log_dir, f"{name}.log")

    def add(self, component: Component) -> Component:
        self.components[component.name] = component
        self._spawn(component)
        return component

    def _spawn(self, c: Component) -> None:
        with open(self.log_path(c.name), "ab") as out:
            out.write(
                f"\n==== start {time.strftime('%H:%M:%S')} (restart {c.restarts}) ====\n".encode()
            )
            out.flush()
            c.log_offset = out.tell()
            c.proc = subprocess.Popen(
                dies_with_parent(c.command or [sys.executable, "-m", "rlax_tasks.cli", *c.argv]),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=with_huge_pages({**os.environ, JOB_NAME_ENV: c.name, **c.env}),
                start_new_session=True,
            )
        c.started_at = time.monotonic()
        c.stopped = False
        log.info("started %s (pid %d)", c.name, c.proc.pid)

    def poll(self) -> dict[str, int]:
        """Restarts dead restartable components; returns {name: exit code} of finished ones.
        Raises ComponentFailed for a failure that restarting will not fix."""
        finished = {}
        for c in self.components.values():
            code = c.proc.poll() if c.proc else None
            if code is None or c.stopped:
                continue
            if code == 0 and not c.restart:
                finished[c.name] = 0
                continue
            if time.monotonic() - c.started_at < self.backoff_s:
                continue
            self._judge(c, code)
            members = [
                m for m in self.components.values() if c.group is not None and m.group == c.group
            ] or [c]
            for m in members:
                if m is not c and m.proc is not None and m.proc.poll() is None:
                    log.warning("%s exited: stopping %s of the same group", c.name, m.name)
                    _kill_group(m.proc)
            for m in members:
                m.restarts += 1
                log.warning(
                    "%s exited with %s: restarting %s (restart %d)",
                    c.name,
                    code,
                    m.name,
                    m.restarts,
                )
                self._spawn(m)
        return finished

    def _judge(self, c: Component, code: int) -> None:
        """Raises ComponentFailed when restarting ``c`` (exited with ``code``) will not help."""
        path = self.log_path(c.name)
        line = error_line(path, c.log_offset)
        detail = error_detail(line) or f"exited with code {code}"
        if code == 2:  # rlax's exit code for a user error: restarting won't help
            raise ComponentFailed(c.name, f"{c.name} failed: {detail} (log: {path})")
        own = code > 0  # killed by a signal, or exit 0: not a streak
        judge_restart(c, line if own else "", detail, path, self.max_restarts, self.progress)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to a component's process group (chaos tests, preemption drills)."""
        c = self.components[name]
        if c.proc and c.proc.poll() is None:
            os.killpg(c.proc.pid, sig)
            c.proc.wait()

    def stop(self, names: Sequence[str] | None = None, timeout_s: float = 10.0) -> None:
        """SIGTERM to every running component's process group, then SIGKILL after
        ``timeout_s``; whatever is left in such a group after its leader exited is killed too.
        The components stay stopped (``poll`` restarts none of them) until added again."""
        targets = [self.components[n] for n in (names or list(self.components))]
        for c in targets:
            c.stopped = True
        running = [c for c in targets if c.proc is not None and c.proc.poll() is None]
        for c in running:
            _signal_group(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in running:
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0fs: killing it", c.name, timeout_s)
            # (only groups whose leader was running just now: a long-gone leader's id may be
            # another process's by now)
            _kill_group(c.proc)


def judge_restart(
    c: Component,
    line: str,
    detail: str,
    path: str,
    max_restarts: int,
    progress: Callable[[], Any] | None,
) -> None:
    """Raises ComponentFailed when ``c`` ended ``max_restarts`` times, or ended with the same
    error ``line`` twice in a row with the same ``progress()`` in between; ``line`` "": an end
    that is not its own failure, which ends a streak, as does an error that depends on another
    component's timing. ``detail``: the error for the message."""
    if c.restarts >= max_restarts:
        raise ComponentFailed(
            c.name, f"{c.name} died {c.restarts + 1} times; giving up; last: {detail} (log: {path})"
        )
    if not line or _TRANSIENT.search(line):
        c.last_failure = None
        return
    now = progress() if progress is not None else None
    if c.last_failure == (line, now):
        raise ComponentFailed(
            c.name,
            f"{c.name} failed twice in a row with the same error and no progress in between: "
            f"{detail} (log: {path})",
        )
    c.last_failure = (line, now)


def error_detail(line: str) -> str:
    """An error line of a log as a message says it: without its ``rlax <cmd>: error:`` prefix."""
    return _CLI_ERROR.sub("", line)


def error_line(path: str, offset: int = 0) -> str:
    """The last error line a component wrote to its log after byte ``offset``: its last
    ``rlax <cmd>: error: ...`` line, else the last line of a traceback, else ""."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(offset, f.tell() - _TAIL_BYTES))
            lines = [x.strip() for x in f.read().decode("utf-8", "replace").splitlines()]
    except OSError:
        return ""
    lines = [x for x in lines if x]
    for pattern in (_CLI_ERROR, _EXCEPTION):
        for x in reversed(lines):
            if pattern.match(x):
                return _TIMESTAMP.sub("", x)
    return ""


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the process group of ``proc`` (its leader and whatever it started there)."""
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


class SignalGuard:
    """What ``stop_on_signals`` yields: ``stopping()`` marks the exit path as begun, after which
    a signal is only logged (it must not interrupt the stopping of the components)."""

    def __init__(self) -> None:
        self.raised = False

    def stopping(self) -> None:
        self.raised = True

    def handler(self, signum: int, _frame: Any) -> None:
        if self.raised:
            log.warning("%s: already stopping the components", signal.Signals(signum).name)
            return
        self.raised = True
        raise Interrupted(signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[SignalGuard]:
    """SIGTERM, SIGINT and SIGHUP raise ``Interrupted`` in the main thread (once), so `rlax run`
    unwinds through its exit path and stops every component; the previous handlers come back at
    the end. Outside the main thread signals cannot be handled: nothing is installed."""
    guard = SignalGuard()
    if threading.current_thread() is not threading.main_thread():
        yield guard
        return
    # a signal ignored when we started (nohup, a background job) stays ignored
    sigs = [
        s
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
        if signal.getsignal(s) is not signal.SIG_IGN
    ]
    previous = {s: signal.signal(s, guard.handler) for s in sigs}
    try:
        yield guard
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
