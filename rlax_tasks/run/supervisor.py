"""A small process supervisor: starts `rlax` components, restarts the ones that die.

Each component runs as ``python -m rlax_tasks.cli <argv>`` in its own process group, with its
output appended to ``<log_dir>/<name>.log``. Ports are chosen once and reused on restart, so the
other components reach a restarted one at the same address.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now (the component binds it a moment later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Component:
    """One supervised process: ``argv`` after ``rlax``; ``restart`` unless it may finish."""

    name: str
    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    restart: bool = True
    # components of one group (the hosts of a multi-host trainer) live and die together: when
    # one dies the others are killed, and all restart
    group: str | None = None
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0


class Supervisor:
    """Starts components, restarts dead ones (with a short back-off), stops them all at exit."""

    def __init__(self, log_dir: str, backoff_s: float = 1.0, max_restarts: int = 50) -> None:
        self.log_dir, self.backoff_s, self.max_restarts = log_dir, backoff_s, max_restarts
        self.components: dict[str, Component] = {}
        os.makedirs(log_dir, exist_ok=True)

    def add(self, component: Component) -> Component:
        self.components[component.name] = component
        self._spawn(component)
        return component

    def _spawn(self, c: Component) -> None:
        out = open(os.path.join(self.log_dir, f"{c.name}.log"), "ab")  # noqa: SIM115
        out.write(
            f"\n==== start {time.strftime('%H:%M:%S')} (restart {c.restarts}) ====\n".encode()
        )
        out.flush()
        c.proc = subprocess.Popen(
            [sys.executable, "-m", "rlax_tasks.cli", *c.argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **c.env},
            start_new_session=True,
        )
        out.close()
        c.started_at = time.monotonic()
        log.info("started %s (pid %d)", c.name, c.proc.pid)

    def poll(self) -> dict[str, int]:
        """Restarts dead restartable components; returns {name: exit code} of finished ones."""
        finished = {}
        for c in self.components.values():
            code = c.proc.poll() if c.proc else None
            if code is None:
                continue
            if code == 0 and not c.restart:
                finished[c.name] = 0
                continue
            if code == 2:  # rlax's exit code for a configuration error: restarting won't help
                raise RuntimeError(
                    f"{c.name} failed with a configuration error; see its log "
                    f"{os.path.join(self.log_dir, c.name + '.log')}"
                )
            if c.restarts >= self.max_restarts:
                raise RuntimeError(f"{c.name} died {c.restarts} times; giving up")
            if time.monotonic() - c.started_at < self.backoff_s:
                continue
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

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to a component's process group (chaos tests, preemption drills)."""
        c = self.components[name]
        if c.proc and c.proc.poll() is None:
            os.killpg(c.proc.pid, sig)
            c.proc.wait()

    def stop(self, names: Sequence[str] | None = None, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        targets = [self.components[n] for n in (names or list(self.components))]
        for c in targets:
            if c.proc and c.proc.poll() is None:
                os.killpg(c.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in targets:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(c.proc.pid, signal.SIGKILL)
                c.proc.wait()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
