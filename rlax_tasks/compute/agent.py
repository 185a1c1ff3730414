"""The node agent: runs the jobs submitted to a Cloud TPU slice.

``python -m rlax_tasks.compute.agent --slice-root ROOT [--worker K] [--entrypoint JSON]``

Started on every host of the slice by ``infra/tpu/startup.sh`` (inside the runtime image). It
polls ``ROOT/jobs/*/spec.json``; each new job is started once through the job runner
(``rlax_tasks.compute.runner``, its own process group) as ``<entrypoint> <argv>`` with the job's
environment. Worker 0 writes the job's status directory itself; worker K>0 writes
``<job>/worker-K/`` (multi-host slices run the same command on every host, as
``jax.distributed`` expects). A ``stop`` marker makes the agent SIGTERM the job's group, then
SIGKILL it after ``--stop-grace`` seconds. A job whose runner was started by an earlier life of
the agent is never started twice: its heartbeat goes stale and the orchestrator retries it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time

from rlax_tasks import storage
from rlax_tasks.compute import jobstatus

log = logging.getLogger(__name__)


class NodeAgent:
    """Starts and stops the jobs that appear under one slice's control directory."""

    def __init__(
        self, slice_root: str, entrypoint: list[str], worker: int = 0, stop_grace_s: float = 10.0
    ) -> None:
        self.slice_root = slice_root
        self.entrypoint = list(entrypoint)
        self.worker = worker
        self.stop_grace_s = stop_grace_s
        self.running: dict[str, subprocess.Popen] = {}
        self.stopping: dict[str, float] = {}
        self.seen: set[str] = set()

    def _status_dir(self, job_dir: str) -> str:
        return job_dir if self.worker == 0 else storage.join(job_dir, f"worker-{self.worker}")

    def poll_once(self) -> None:
        """One pass: start new jobs, stop jobs asked to stop, forget finished ones."""
        jobs_root = storage.join(self.slice_root, "jobs")
        for name in storage.list_children(jobs_root):
            job_dir = storage.join(jobs_root, name)
            if name in self.running:
                self._maybe_stop(name, job_dir)
                continue
            if name in self.seen:
                continue
            spec = jobstatus.read_json(storage.join(job_dir, jobstatus.SPEC))
            if spec is None:
                continue  # not fully written yet
            self.seen.add(name)
            status_dir = self._status_dir(job_dir)
            if storage.exists(storage.join(status_dir, jobstatus.RUNNER)):
                log.warning("job %s was started by an earlier agent; not starting it again", name)
                continue
            if storage.exists(storage.join(job_dir, jobstatus.STOP)):
                continue
            self._start(name, status_dir, spec)
        for name, proc in list(self.running.items()):
            if proc.poll() is not None:
                del self.running[name]
                self.stopping.pop(name, None)

    def _start(self, name: str, status_dir: str, spec: dict) -> None:
        job = spec["job"]
        command = [*self.entrypoint, *job["argv"]]
        runner = [
            sys.executable,
            "-m",
            "rlax_tasks.compute.runner",
            "--status-dir",
            status_dir,
            "--heartbeat-interval",
            str(spec.get("heartbeat_interval_s", 5.0)),
            "--",
            *command,
        ]
        env = {**os.environ, **job.get("env", {}), "RLAX_WORKER_ID": str(self.worker)}
        self.running[name] = subprocess.Popen(
            runner, env=env, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.info("started job %s: %s", name, command)

    def _maybe_stop(self, name: str, job_dir: str) -> None:
        proc = self.running[name]
        if name not in self.stopping:
            if not storage.exists(storage.join(job_dir, jobstatus.STOP)):
                return
            log.info("stopping job %s", name)
            self.stopping[name] = time.monotonic()
            _signal_group(proc.pid, signal.SIGTERM)
        elif time.monotonic() - self.stopping[name] > self.stop_grace_s:
            _signal_group(proc.pid, signal.SIGKILL)

    def run(self, poll_s: float = 2.0) -> None:
        """Polls forever (the node's lifetime)."""
        log.info("node agent on worker %d watching %s", self.worker, self.slice_root)
        while True:
            try:
                self.poll_once()
            except Exception:  # noqa: BLE001 - a storage hiccup must not kill the node's agent
                log.warning("agent poll failed", exc_info=True)
            time.sleep(poll_s)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlax-node-agent", description=__doc__.splitlines()[0])
    p.add_argument("--slice-root", required=True, help="the slice's control dir (gs:// or local)")
    p.add_argument("--worker", type=int, default=0, help="this host's index in the slice")
    p.add_argument("--entrypoint", default='["rlax"]', help="JSON list: the rlax command")
    p.add_argument("--poll", type=float, default=2.0, help="seconds between polls")
    p.add_argument("--stop-grace", type=float, default=10.0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s agent: %(message)s")
    entrypoint = json.loads(args.entrypoint)
    if not isinstance(entrypoint, list) or not entrypoint:
        p.error("--entrypoint must be a non-empty JSON list of strings")
    NodeAgent(args.slice_root, entrypoint, args.worker, args.stop_grace).run(args.poll)
    return 0


if __name__ == "__main__":
    sys.exit(main())
