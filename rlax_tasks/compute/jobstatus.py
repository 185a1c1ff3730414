"""The job status directory: the files a job runner writes and how a job's state is read back.

Every job has a status directory (a local path or a gs:// prefix) written only by its runner
(``rlax_tasks.compute.runner``) and by ``stop_job``; since the state is derived from these files
alone, any process (an Airflow worker, the triggerer, a restarted worker) can read it."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

import psutil

from rlax_tasks.compute.types import CONFIG_ERROR_EXIT_CODE, JobHandle, JobState, JobStatus
from rlax_tasks.rundir import storage

SPEC = "spec.json"  # the job spec and command line, written when the job is submitted
RUNNER = "runner.json"  # {"pid", "create_time", "host", "started_at"} of the runner process
HEARTBEAT = "heartbeat"  # {"time": unix seconds}, rewritten every few seconds while it runs
EXIT = "exit.json"  # {"returncode", "finished_at"}, written once when the command ends
STOP = "stop"  # marker: a stop was requested (the job is not retried as preempted)
STDOUT = "stdout.log"
STDERR = "stderr.log"
# beside jobs/ in a slice's control directory: one record per host (see host_record_path)
HOSTS = "hosts"

# signals that mean "the machine/process was taken away", not "the program is broken"
_PREEMPTION_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP}


def read_json(path: str) -> dict[str, Any] | None:
    """The JSON object at ``path``, or None when it does not exist (or is half-written)."""
    try:
        return json.loads(storage.read_bytes(path))
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_json(path: str, obj: dict[str, Any]) -> None:
    storage.write_bytes(path, json.dumps(obj, sort_keys=True).encode())


def running_handle(spec_path: str, job_state: Callable[[JobHandle], JobStatus]) -> JobHandle | None:
    """The handle in the job spec at ``spec_path`` while that job still runs (``job_state``: the
    backend's), else None: a job started again while it runs is returned, not started twice."""
    previous = read_json(spec_path)
    if previous is None:
        return None
    old = JobHandle.from_dict(previous["handle"])
    return old if job_state(old).state is JobState.RUNNING else None


def next_attempt(
    jobs_dir: str, job_name: str, job_state: Callable[[JobHandle], JobStatus]
) -> tuple[int, JobHandle | None]:
    """The next attempt number of ``job_name`` (its attempts are ``<jobs_dir>/<job>.<n>/``) and
    the handle of the last attempt while it still runs (``running_handle``)."""
    attempts = []
    for child in storage.list_children(jobs_dir):
        base, _, n = child.rpartition(".")
        if base == job_name and n.isdigit():
            attempts.append(int(n))
    if not attempts:
        return 1, None
    last = max(attempts)
    spec = storage.join(jobs_dir, f"{job_name}.{last}", SPEC)
    return last + 1, running_handle(spec, job_state)


def classify_exit(returncode: int, stopped: bool, stderr_tail: str = "") -> JobStatus:
    """The job state for a finished command with ``returncode`` (negative: killed by a signal)."""
    tail = f": {stderr_tail.strip()}" if stderr_tail.strip() else ""
    if returncode == 0:
        return JobStatus(JobState.SUCCEEDED, "exit code 0", 0)
    if stopped:
        return JobStatus(
            JobState.FAILED, f"stopped by request (exit code {returncode})", returncode
        )
    if returncode == CONFIG_ERROR_EXIT_CODE:
        return JobStatus(
            JobState.FAILED, f"configuration error (exit code {returncode}){tail}", returncode
        )
    if returncode < 0:
        try:
            sig = signal.Signals(-returncode)
        except ValueError:
            sig = None
        if sig in _PREEMPTION_SIGNALS:
            return JobStatus(JobState.PREEMPTED, f"killed by {sig.name}", returncode)
        name = sig.name if sig else f"signal {-returncode}"
        return JobStatus(JobState.FAILED, f"crashed with {name}{tail}", returncode)
    return JobStatus(JobState.FAILED, f"exit code {returncode}{tail}", returncode)


def _tail(path: str, n_chars: int = 500) -> str:
    try:
        data = storage.read_bytes(path)
    except FileNotFoundError:
        return ""
    text = data[-n_chars:].decode(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _runner_gone(runner: dict[str, Any]) -> bool:
    """Whether the runner recorded in ``runner`` ran on this host and no longer exists."""
    if runner.get("host") != socket.gethostname():
        return False
    try:
        proc = psutil.Process(int(runner["pid"]))
        alive = abs(proc.create_time() - float(runner["create_time"])) < 1.0
        return not alive or proc.status() == psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, KeyError, ValueError):
        return True


def read_job_status(
    status_dir: str,
    heartbeat_timeout_s: float,
    submitted_at: float,
    now: float | None = None,
    stopped: bool | None = None,
) -> JobStatus:
    """The state of the job whose runner writes ``status_dir``.

    Finished: by exit code (0 ok, 2 configuration error, SIGKILL/SIGTERM preempted).
    Unfinished: PREEMPTED when its runner vanished or its heartbeat (else its submission) is older
    than ``heartbeat_timeout_s``; else RUNNING. ``stopped``: default, the ``stop`` marker exists."""
    return _read_status(status_dir, heartbeat_timeout_s, submitted_at, now, stopped)[0]


def _read_status(
    status_dir: str,
    heartbeat_timeout_s: float,
    submitted_at: float,
    now: float | None,
    stopped: bool | None,
) -> tuple[JobStatus, float]:
    """(status, when it ended: exit time, or the last sign of life of a lost job)."""
    now = time.time() if now is None else now
    if stopped is None:
        stopped = storage.exists(storage.join(status_dir, STOP))

    def finished() -> tuple[JobStatus, float] | None:
        ex = read_json(storage.join(status_dir, EXIT))
        if ex is None:
            return None
        status = classify_exit(
            int(ex["returncode"]), stopped, _tail(storage.join(status_dir, STDERR))
        )
        return status, float(ex.get("finished_at", now))

    if (done := finished()) is not None:
        return done
    runner = read_json(storage.join(status_dir, RUNNER))
    beat = read_json(storage.join(status_dir, HEARTBEAT))
    if beat is not None:
        last, what = float(beat["time"]), "heartbeat"
    elif runner is not None:
        last, what = float(runner["started_at"]), "start of the runner (no heartbeat yet)"
    else:
        last, what = submitted_at, "submission (the job never started)"
    if runner is not None and _runner_gone(runner):
        # it may have written its exit code just before exiting
        if (done := finished()) is not None:
            return done
        if stopped:
            return JobStatus(JobState.FAILED, "stopped by request"), last
        return JobStatus(JobState.PREEMPTED, "runner process vanished without an exit code"), last
    age = max(0.0, now - last)
    if age > heartbeat_timeout_s:
        if stopped:
            return JobStatus(JobState.FAILED, "stopped by request"), last
        return JobStatus(
            JobState.PREEMPTED,
            f"no heartbeat for {age:.0f}s since the {what} (timeout {heartbeat_timeout_s:g}s)",
        ), last
    return JobStatus(JobState.RUNNING, f"last {what} {age:.0f}s ago"), now


def host_status_dir(job_dir: str, host: int) -> str:
    """Where host ``host`` of a job's slice writes its status: the job's own directory for
    host 0, ``<job_dir>/worker-<host>/`` for the others."""
    return job_dir if host == 0 else storage.join(job_dir, f"worker-{host}")


def host_record_path(slice_root: str, host: int) -> str:
    """``<slice_root>/hosts/<host>.json``: {"address", "worker", "time"}, published by the node
    agent of that host when it starts (a multi-host job's coordinator is on its first host)."""
    return storage.join(slice_root, HOSTS, f"{host}.json")


# when two hosts end abnormally at the same moment, the more telling cause wins
_CAUSE_RANK = {JobState.FAILED: 1, JobState.PREEMPTED: 2}


def read_group_status(
    job_dir: str,
    hosts: tuple[int, ...] | list[int],
    heartbeat_timeout_s: float,
    submitted_at: float,
    now: float | None = None,
) -> JobStatus:
    """The state of a job that runs on ``hosts`` of its slice (one process group).

    SUCCEEDED when every host exited 0; RUNNING while none ended abnormally. Once one host did,
    the job did: a configuration error (exit 2) on any host says why, else the first host to end
    (the others' ends are its consequences). Host 0 alone reads as ``read_job_status``."""
    hosts = tuple(hosts)
    if hosts == (0,):
        return read_job_status(job_dir, heartbeat_timeout_s, submitted_at, now)
    stopped = storage.exists(storage.join(job_dir, STOP))
    ended, running = [], 0
    for host in hosts:
        status, when = _read_status(
            host_status_dir(job_dir, host), heartbeat_timeout_s, submitted_at, now, stopped
        )
        if status.state in (JobState.FAILED, JobState.PREEMPTED):
            rank = 0 if status.is_config_error else _CAUSE_RANK[status.state]
            ended.append((rank > 0, when, rank, host, status))
        running += status.state is JobState.RUNNING
    if ended:
        *_, host, status = min(ended)
        more = f" ({len(ended) - 1} other host(s) ended too)" if len(ended) > 1 else ""
        return JobStatus(status.state, f"host {host}: {status.message}{more}", status.exit_code)
    if running:
        return JobStatus(JobState.RUNNING, f"{running} of {len(hosts)} hosts running")
    return JobStatus(JobState.SUCCEEDED, f"exit code 0 on all {len(hosts)} hosts", 0)
