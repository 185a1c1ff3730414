"""The node agent: runs the jobs submitted to a Cloud TPU slice, on every host of it.

Started on each host by ``infra/tpu/startup.sh``: publishes ``ROOT/hosts/K.json``, then starts
each job of ``ROOT/jobs/`` meant for host K through the job runner, and stops a job's group when
asked, when a peer host's process failed, or when superseded. It never starts a job twice."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from rlax_tasks.compute import jobstatus
from rlax_tasks.compute.runner import runner_argv
from rlax_tasks.compute.types import (
    COORDINATOR_ADDRESS_ENV,
    HOST_ADDRESS_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    WORKER_ID_ENV,
    coordinator_port,
)
from rlax_tasks.rundir import storage

log = logging.getLogger(__name__)


def primary_address() -> str:
    """This machine's primary IP address (the one its default route leaves from)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # UDP: selects a route, sends nothing
            return s.getsockname()[0]
    except OSError:
        try:
            return socket.gethostbyname(socket.gethostname())
        except OSError:
            return "127.0.0.1"


def _split_attempt(name: str) -> tuple[str, int]:
    base, _, attempt = name.rpartition(".")
    return (base, int(attempt)) if base and attempt.isdigit() else (name, 0)


class NodeAgent:
    """Starts and stops the jobs meant for this host under one slice's control directory."""

    def __init__(
        self,
        slice_root: str,
        entrypoint: list[str],
        worker: int = 0,
        stop_grace_s: float = 10.0,
        address: str | None = None,
        address_wait_s: float = 300.0,
        peer_check_s: float = 5.0,
    ) -> None:
        self.slice_root = slice_root
        self.entrypoint = list(entrypoint)
        self.worker = worker
        self.stop_grace_s = stop_grace_s
        self.address = address or primary_address()
        self.address_wait_s = address_wait_s
        self.peer_check_s = peer_check_s
        self.published = False
        self.running: dict[str, subprocess.Popen] = {}
        self.hosts_of: dict[str, tuple[int, ...]] = {}
        self.stopping: dict[str, float] = {}
        self.peers_checked: dict[str, float] = {}
        self.waiting: dict[str, float] = {}  # job → since when it waits for its first host
        self.seen: set[str] = set()

    def publish(self) -> None:
        """Writes ``hosts/<worker>.json`` so multi-host jobs find this host."""
        record = {"address": self.address, "worker": self.worker, "time": time.time()}
        jobstatus.write_json(jobstatus.host_record_path(self.slice_root, self.worker), record)
        self.published = True
        log.info("host %d publishes address %s", self.worker, self.address)

    def poll_once(self) -> None:
        """One pass: start new jobs, stop jobs asked to stop, forget finished ones."""
        if not self.published:
            self.publish()
        jobs_root = storage.join(self.slice_root, "jobs")
        names = storage.list_children(jobs_root)
        newest: dict[str, int] = {}
        for name in names:
            base, attempt = _split_attempt(name)
            newest[base] = max(newest.get(base, 0), attempt)
        for name in names:
            job_dir = storage.join(jobs_root, name)
            if name in self.running:
                base, attempt = _split_attempt(name)
                self._maybe_stop(name, job_dir, superseded=newest[base] > attempt)
            elif name not in self.seen:
                self._maybe_start(name, job_dir)
        for name, proc in list(self.running.items()):
            if proc.poll() is not None:
                del self.running[name]
                for state in (self.stopping, self.hosts_of, self.peers_checked):
                    state.pop(name, None)

    def _maybe_start(self, name: str, job_dir: str) -> None:
        spec = jobstatus.read_json(storage.join(job_dir, jobstatus.SPEC))
        if spec is None:
            return  # not fully written yet
        hosts = tuple(spec["job"].get("hosts") or (0,))
        if self.worker not in hosts:
            self.seen.add(name)  # meant for other hosts of the slice
            return
        status_dir = jobstatus.host_status_dir(job_dir, self.worker)
        if storage.exists(storage.join(status_dir, jobstatus.RUNNER)):
            log.warning("job %s was started by an earlier agent; not starting it again", name)
            self.seen.add(name)
            return
        if storage.exists(storage.join(job_dir, jobstatus.STOP)):
            self.seen.add(name)
            return
        group_env = self._group_env(name, hosts, spec["job"].get("env", {}))
        if group_env is None:
            return  # waiting for the first host's address
        self.seen.add(name)
        self.waiting.pop(name, None)
        self.hosts_of[name] = hosts
        self._start(name, status_dir, spec, group_env)

    def _group_env(self, name: str, hosts: tuple[int, ...], env: dict) -> dict[str, str] | None:
        """The variables this host's process of the job gets; None while the job's first host
        has not published its address (after ``address_wait_s`` the job is given up on)."""
        out = {WORKER_ID_ENV: str(self.worker), HOST_ADDRESS_ENV: self.address}
        if len(hosts) == 1:
            return out
        leader = hosts[0]
        address = self.address if leader == self.worker else self._host_address(leader)
        if address is None:
            now = time.monotonic()
            since = self.waiting.setdefault(name, now)
            path = jobstatus.host_record_path(self.slice_root, leader)
            if since == now:
                log.info("job %s waits for host %d to publish its address (%s)", name, leader, path)
            elif now - since > self.address_wait_s:
                log.error(
                    "job %s: host %d has not published its address (%s) in %.0fs; not starting "
                    "it here (its heartbeat goes stale: the job reads as PREEMPTED)",
                    name,
                    leader,
                    path,
                    self.address_wait_s,
                )
                self.seen.add(name)
                self.waiting.pop(name)
            return None
        host = f"[{address}]" if ":" in address else address
        out.update(
            {
                PROCESS_ID_ENV: str(hosts.index(self.worker)),
                NUM_PROCESSES_ENV: str(len(hosts)),
                COORDINATOR_ADDRESS_ENV: f"{host}:{coordinator_port(env)}",
            }
        )
        return out

    def _host_address(self, host: int) -> str | None:
        record = jobstatus.read_json(jobstatus.host_record_path(self.slice_root, host))
        return (record or {}).get("address") or None

    def _start(self, name: str, status_dir: str, spec: dict, group_env: dict[str, str]) -> None:
        job = spec["job"]
        command = [*self.entrypoint, *job["argv"]]
        runner = runner_argv(status_dir, command, spec.get("heartbeat_interval_s", 5.0))
        env = {**os.environ, **job.get("env", {}), **group_env}
        self.running[name] = subprocess.Popen(
            runner, env=env, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.info("started job %s on host %d: %s", name, self.worker, command)

    def _maybe_stop(self, name: str, job_dir: str, superseded: bool) -> None:
        proc = self.running[name]
        if name not in self.stopping:
            why = self._why_stop(name, job_dir, superseded)
            if why is None:
                return
            log.info("stopping job %s on host %d: %s", name, self.worker, why)
            self.stopping[name] = time.monotonic()
            _signal_group(proc.pid, signal.SIGTERM)
        elif time.monotonic() - self.stopping[name] > self.stop_grace_s:
            _signal_group(proc.pid, signal.SIGKILL)

    def _why_stop(self, name: str, job_dir: str, superseded: bool) -> str | None:
        if storage.exists(storage.join(job_dir, jobstatus.STOP)):
            return "stop requested"
        if superseded:
            return "a newer attempt of the job was submitted"
        hosts = self.hosts_of.get(name, (0,))
        now = time.monotonic()
        if len(hosts) == 1 or now - self.peers_checked.get(name, 0.0) < self.peer_check_s:
            return None
        self.peers_checked[name] = now
        # the first host watches every other; the others watch the first (one read each)
        peers = [h for h in hosts if h != self.worker] if self.worker == hosts[0] else hosts[:1]
        for peer in peers:
            ex = _exit_record(jobstatus.host_status_dir(job_dir, peer))
            if ex is not None and int(ex.get("returncode", 0)) != 0:
                return f"host {peer}'s process of the job exited with {ex['returncode']}"
        return None

    def run(self, poll_s: float = 2.0) -> None:
        """Polls forever (the node's lifetime)."""
        log.info("node agent on host %d watching %s", self.worker, self.slice_root)
        while True:
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - a storage hiccup must not kill the node's agent
                log.warning("agent poll failed", exc_info=True)
            time.sleep(poll_s)


def _exit_record(status_dir: str) -> dict[str, Any] | None:
    return jobstatus.read_json(storage.join(status_dir, jobstatus.EXIT))


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlax-node-agent", description=__doc__.splitlines()[0])
    p.add_argument("--slice-root", required=True, help="the slice's control dir (gs:// or local)")
    p.add_argument("--worker", type=int, default=0, help="this host's index in the slice")
    p.add_argument(
        "--address",
        default=None,
        help="where other hosts reach this one (default: this machine's primary IP)",
    )
    p.add_argument("--entrypoint", default='["rlax"]', help="JSON list: the rlax command")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between polls")
    p.add_argument("--stop-grace", type=float, default=10.0)
    p.add_argument(
        "--address-wait",
        type=float,
        default=300.0,
        help="seconds a multi-host job waits for its first host's address before giving up",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s agent: %(message)s")
    entrypoint = json.loads(args.entrypoint)
    if not isinstance(entrypoint, list) or not entrypoint:
        p.error("--entrypoint must be a non-empty JSON list of strings")
    if args.worker < 0:
        p.error(f"--worker must be >= 0, got {args.worker}")
    agent = NodeAgent(
        args.slice_root,
        entrypoint,
        args.worker,
        args.stop_grace,
        address=args.address,
        address_wait_s=args.address_wait,
        peer_check_s=max(args.poll, 5.0),
    )
    agent.run(args.poll)
    return 0


if __name__ == "__main__":
    sys.exit(main())
