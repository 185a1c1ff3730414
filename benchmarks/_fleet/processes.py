"""The fleet simulation's processes: a child spoken to over a pipe, the simulated fleet and
its workers file, the churn clock (benchmarks/fleet.py)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
from typing import Any

import numpy as np

from rlax_tasks.rundir import storage

START_TIMEOUT_S = 120.0  # a child's start, or a host's spawning of its workers


def _child_entry(target: Any, level: int, conn: Any, settings: Any) -> None:
    """A child's start: its log lines at ``level`` and above, then ``target(conn, settings)``."""
    logging.basicConfig(level=level, format="%(asctime)s %(processName)s %(name)s: %(message)s")
    target(conn, settings)


class Child:
    """A child process running ``target(conn, settings)``, spoken to over a pipe."""

    log_level = logging.ERROR  # the children's (``--child-log-level``)

    def __init__(self, ctx: Any, name: str, target: Any, settings: Any) -> None:
        self.name = name
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child_entry,
            args=(target, self.log_level, theirs, settings),
            name=name,
            daemon=True,
        )
        self.proc.start()
        theirs.close()
        self.peak_rss = 0
        self.cpu_s = 0.0

    def recv(self, timeout_s: float = 60.0) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"{self.name}: no answer within {timeout_s:.0f}s")
        reply = self.conn.recv()
        if isinstance(reply, Exception):
            raise reply
        return reply

    def call(self, command: str, *args: Any, timeout_s: float = 60.0) -> Any:
        self.conn.send((command, args))
        return self.recv(timeout_s)

    def sample(self) -> None:
        """Notes the process's RSS (its peak so far) and CPU seconds (user + system)."""
        import psutil

        try:
            proc = psutil.Process(self.proc.pid)
            self.peak_rss = max(self.peak_rss, proc.memory_info().rss)
            times = proc.cpu_times()
            self.cpu_s = times.user + times.system
        except psutil.Error:
            pass

    def end(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)


@dataclasses.dataclass
class Fleet:
    """The simulated workers: which host runs each, which are alive, the workers file."""

    path: str
    hosts: list[Child]
    urls: dict[str, str] = dataclasses.field(default_factory=dict)
    host_of: dict[str, int] = dataclasses.field(default_factory=dict)
    live: list[str] = dataclasses.field(default_factory=list)
    next_index: int = 0

    def write(self) -> None:
        storage.write_bytes(self.path, json.dumps(self.urls, sort_keys=True).encode())

    def spawn(self, host: int, count: int, order: Any, slow: Any, pull: bool = True) -> None:
        """Starts ``count`` workers on ``host``: the i-th one tries replicas ``order(i)`` (its
        home first); they pull weights at once, or (not ``pull``) when the host is told
        "pull"."""
        specs = []
        for _ in range(count):
            i, self.next_index = self.next_index, self.next_index + 1
            worker_id = f"w{i:05d}"
            specs.append((worker_id, order(i), bool(slow())))
            self.host_of[worker_id] = host
        urls = self.hosts[host].call("spawn", specs, pull, timeout_s=START_TIMEOUT_S)
        self.urls.update(urls)
        self.live.extend(urls)

    def kill(self, worker_id: str) -> None:
        self.hosts[self.host_of[worker_id]].call("kill", [worker_id])
        self.live.remove(worker_id)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"live": 0, "held": {}}
        for h in self.hosts:
            s = h.call("stats")
            out["live"] += s["live"]
            for k, v in s["held"].items():
                out["held"][k] = out["held"].get(k, 0) + v
        return out


def wait_for(ok: Any, timeout_s: float, every_s: float = 0.5) -> float | None:
    """Polls ``ok()`` until true; the seconds it took, None when not within ``timeout_s``."""
    t0 = time.monotonic()
    while not ok():
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(every_s)
    return time.monotonic() - t0


class Churn:
    """When workers are preempted: a Poisson process at ``--churn-per-minute`` of the fleet."""

    def __init__(self, args: argparse.Namespace, rng: np.random.Generator) -> None:
        self.rate = args.churn_per_minute * args.workers / 60.0  # per second
        self.rng = rng
        self.next = time.monotonic() + self._gap()
        self.events = 0

    def _gap(self) -> float:
        return float(self.rng.exponential(1 / self.rate)) if self.rate > 0 else math.inf

    def due(self, now: float) -> int:
        n = 0
        while now >= self.next:
            n += 1
            self.next += self._gap()
        self.events += n
        return n
