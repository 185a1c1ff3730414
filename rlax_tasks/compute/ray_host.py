"""One host's process of a ``ray`` backend job: the Ray actor that runs the job runner on the
host's bundle and records its end, and the parent-death tie that ends a job's processes with
the actor (Ray ends a dead actor's children, not theirs)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psutil

from rlax_tasks.compute import jobstatus
from rlax_tasks.compute.local import default_entrypoint
from rlax_tasks.compute.runner import runner_argv
from rlax_tasks.compute.types import JobState, JobStatus
from rlax_tasks.process.ports import free_port
from rlax_tasks.rundir import storage

# set by Ray for its worker processes, not meant for the job (OMP_NUM_THREADS=1: a 0-CPU actor)
_RAY_WORKER_ENV = (
    "OMP_NUM_THREADS",
    "PYTHONBREAKPOINT",
    "RAY_JOB_ID",
    "RAY_RAYLET_PID",
    "SPT_NOENV",
)
# exec argv[2:] with SIGKILL as its parent-death signal (prctl PR_SET_PDEATHSIG, kept across
# exec), or exit at once if its parent (pid in TIED_PARENT_ENV) already ended; with argv[1] "+",
# the children of what it execs are told its pid
TIED_PARENT_ENV = "RLAX_TIED_PARENT"
_TIE_TO_PARENT = f"""
import ctypes, os, signal, sys
parent = int(os.environ.pop("{TIED_PARENT_ENV}", "0"))
ctypes.CDLL(None).prctl(1, signal.SIGKILL)
if parent and os.getppid() != parent:
    os._exit(128 + signal.SIGKILL)
if sys.argv[1] == "+":
    os.environ["{TIED_PARENT_ENV}"] = str(os.getpid())
os.execvp(sys.argv[2], sys.argv[2:])
"""


class HostProcess:
    """One host's process of a job, as a Ray actor on the host's bundle: the job runner running
    the job's command, its end recorded for ``status``."""

    def __init__(self, status_dir: str) -> None:
        self.status_dir = status_dir
        self.proc: subprocess.Popen | None = None
        self.ended_at: float | None = None
        self.start_error: Exception | None = None
        self.stopped = False  # stopped on request: FAILED, not retried as preempted
        self._stopping = threading.Lock()

    def start(
        self, entrypoint: list[str] | None, argv: list[str], env: dict, interval: float
    ) -> list[str]:
        """Starts ``<entrypoint> <argv>`` under the runner; returns the command."""
        command = [*(entrypoint or default_entrypoint()), *argv]
        tied_command = _tied_to_parent(command, pass_on=False)
        runner = _tied_to_parent(runner_argv(self.status_dir, tied_command, interval), pass_on=True)
        env = {k: v for k, v in os.environ.items() if k not in _RAY_WORKER_ENV} | env
        env[TIED_PARENT_ENV] = str(os.getpid())
        started = threading.Event()
        # the runner's parent-death signal fires when the thread that started it ends: this one
        # lives as long as the runner
        threading.Thread(target=self._run, args=(runner, env, started), daemon=True).start()
        started.wait()
        if self.start_error is not None:
            raise self.start_error
        return command

    def _run(self, runner: list[str], env: dict[str, str], started: threading.Event) -> None:
        """Starts the runner (logging to ``runner.log`` beside a local status), waits for it."""
        try:
            log_file = None
            if not storage.is_gcs(self.status_dir):
                os.makedirs(self.status_dir, exist_ok=True)
                log_file = open(os.path.join(self.status_dir, "runner.log"), "ab")
            with log_file or contextlib.nullcontext():
                self.proc = subprocess.Popen(
                    runner, env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file
                )
        except Exception as e:  # noqa: BLE001 - start raises it to its caller
            self.start_error = e
            return
        finally:
            started.set()
        self.proc.wait()
        self.ended_at = time.time()

    def status(self) -> tuple[dict[str, Any], float | None]:
        """(JobStatus dict, when the process ended or None)."""
        if self.ended_at is None:
            return JobStatus(JobState.RUNNING, "running").to_dict(), None
        if storage.exists(storage.join(self.status_dir, jobstatus.EXIT)):
            status = jobstatus.read_job_status(self.status_dir, 1.0, 0.0, stopped=self.stopped)
        else:  # the runner itself was killed before it could write the exit code
            status = jobstatus.classify_exit(self.proc.returncode, self.stopped)
        return status.to_dict(), self.ended_at

    def stop(self, grace_s: float, requested: bool) -> None:
        """SIGTERM to the runner (it forwards it to the command), SIGKILL to both after
        ``grace_s``; returns at once."""
        if requested and not self.stopped:
            self.stopped = True
            if self.proc is not None and self.ended_at is None:  # for readers of its files
                stop_path = storage.join(self.status_dir, jobstatus.STOP)
                jobstatus.write_json(stop_path, {"time": time.time()})
        if self.proc is None or self.ended_at is not None or not self._stopping.acquire(False):
            return
        self.proc.send_signal(signal.SIGTERM)
        threading.Thread(target=self._kill_after, args=(grace_s,), daemon=True).start()

    def _kill_after(self, grace_s: float) -> None:
        try:
            self.proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            pass
        try:
            runner = psutil.Process(self.proc.pid)
            processes = [*runner.children(recursive=True), runner]
        except psutil.NoSuchProcess:
            return
        for process in processes:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass

    def wait(self, timeout_s: float) -> bool:
        """Whether the process ended within ``timeout_s``."""
        try:
            if self.proc is not None:
                self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True


def free_coordinator_port() -> int:
    """A port free on this node now for a multi-host job's coordinator, which listens on every
    interface (a Ray task's answer; ``process.ports.free_port``)."""
    return free_port(host="")


def sees_path(path: str) -> bool:
    """Whether this node's file system holds ``path`` (the ray backend's shared run root check,
    run as a task on every node)."""
    return os.path.exists(path)


def _tied_to_parent(argv: list[str], pass_on: bool) -> list[str]:
    """``argv`` run with SIGKILL as its parent-death signal (Linux), so that a job's processes
    end with the process that started them, even a SIGKILLed one: Ray ends the children of a
    dead actor (killed, or its node lost), not their children. ``pass_on``: so are its own
    children started through this."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-c", _TIE_TO_PARENT, "+" if pass_on else "-", *argv]
