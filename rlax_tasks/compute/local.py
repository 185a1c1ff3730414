"""The ``local`` backend (the embedded default): slices are directories, jobs local processes.

A slice is ``<run_root>/<run_id>/slices/<name>/``, READY once it exists. A job is a runner
process (``compute.runner``) running ``<entrypoint> <argv>`` (default: ``python -m rlax_tasks.cli``)
with its status in ``<slice>/jobs/<job name>/``; a retry moves a finished one aside."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

from rlax_tasks.compute import jobstatus
from rlax_tasks.compute.runner import runner_argv
from rlax_tasks.compute.types import (
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    SliceHandle,
    SliceSpec,
    SliceState,
    has_labels,
)
from rlax_tasks.rundir.paths import SLICES

log = logging.getLogger(__name__)

SLICE_FILE = "slice.json"


def default_entrypoint() -> list[str]:
    """``python -m rlax_tasks.cli``: the `rlax` command in this interpreter."""
    return [sys.executable, "-m", "rlax_tasks.cli"]


def heartbeat_interval(timeout_s: float, cap_s: float = 5.0) -> float:
    """How often a runner beats so that a few missed beats are tolerated before preemption."""
    return max(0.2, min(cap_s, timeout_s / 4))


class LocalBackend:
    """Slices as local directories, jobs as detached local runner processes."""

    name = "local"

    def __init__(
        self,
        run_root: str = "runs",
        entrypoint: list[str] | None = None,
        heartbeat_interval_s: float | None = None,
        stop_grace_s: float = 10.0,
    ) -> None:
        if not isinstance(run_root, str) or not run_root:
            raise ValueError("local backend: run_root must be a directory path")
        if run_root.startswith("gs://"):
            raise ValueError(
                f"local backend: run_root={run_root!r} is a gs:// URI; local slices live on the "
                "local disk (use the cloud_tpu backend for GCS run roots)"
            )
        self.run_root = os.path.abspath(run_root)
        self.entrypoint = list(entrypoint) if entrypoint else default_entrypoint()
        self.heartbeat_interval_s = heartbeat_interval_s
        self.stop_grace_s = float(stop_grace_s)

    # ------------------------------------------------------------------ slices
    def _slice_dir(self, spec: SliceSpec) -> str:
        return os.path.join(self.run_root, spec.run_id, SLICES, spec.name)

    def _handle(self, spec: SliceSpec, info: dict[str, Any]) -> SliceHandle:
        return SliceHandle(
            backend=self.name,
            name=spec.name,
            root=self._slice_dir(spec),
            instance_id=info["instance_id"],
            spec=spec.to_dict(),
        )

    def provision(self, spec: SliceSpec) -> SliceHandle:
        """Creates the slice directory (idempotent: an existing READY slice is returned)."""
        path = os.path.join(self._slice_dir(spec), SLICE_FILE)
        info = jobstatus.read_json(path)
        if info is not None and info.get("state") == SliceState.READY.value:
            return self._handle(SliceSpec.from_dict(info["spec"]), info)
        spec = spec.managed()
        info = {
            "state": SliceState.READY.value,
            "instance_id": uuid.uuid4().hex[:12],
            "spec": spec.to_dict(),
            "created_at": time.time(),
        }
        jobstatus.write_json(path, info)
        log.info("local slice %s ready at %s", spec.name, self._slice_dir(spec))
        return self._handle(spec, info)

    def slice_state(self, handle: SliceHandle | dict) -> SliceState:
        handle = SliceHandle.from_dict(handle)
        info = jobstatus.read_json(os.path.join(handle.root, SLICE_FILE))
        if info is None or info.get("instance_id") != handle.instance_id:
            return SliceState.DELETED  # gone, or re-created since this handle was issued
        return SliceState(info["state"])

    def teardown(self, handle: SliceHandle | dict) -> None:
        """Stops every job still running on the slice and marks it DELETED (logs are kept)."""
        handle = SliceHandle.from_dict(handle)
        path = os.path.join(handle.root, SLICE_FILE)
        info = jobstatus.read_json(path)
        if info is None or info.get("state") == SliceState.DELETED.value:
            return
        jobs_dir = os.path.join(handle.root, "jobs")
        for name in sorted(os.listdir(jobs_dir)) if os.path.isdir(jobs_dir) else []:
            status_dir = os.path.join(jobs_dir, name)
            if not os.path.exists(os.path.join(status_dir, jobstatus.EXIT)):
                self._kill(status_dir, mark_stop=True)
        info["state"] = SliceState.DELETED.value
        info["deleted_at"] = time.time()
        jobstatus.write_json(path, info)
        log.info("local slice %s torn down", handle.name)

    def list_slices(self, label_filter: dict[str, str] | None = None) -> list[SliceHandle]:
        """Every live slice under run_root whose labels include ``label_filter``."""
        out = []
        runs = sorted(os.listdir(self.run_root)) if os.path.isdir(self.run_root) else []
        for run in runs:
            slices = os.path.join(self.run_root, run, SLICES)
            for name in sorted(os.listdir(slices)) if os.path.isdir(slices) else []:
                info = jobstatus.read_json(os.path.join(slices, name, SLICE_FILE))
                if info is None or info.get("state") == SliceState.DELETED.value:
                    continue
                spec = SliceSpec.from_dict(info["spec"])
                if has_labels(spec.labels, label_filter):
                    out.append(self._handle(spec, info))
        return out

    # ------------------------------------------------------------------ jobs
    def start_job(self, handle: SliceHandle | dict, job: JobSpec) -> JobHandle:
        """Starts ``job`` on the slice; a job of that name that is still running is returned
        as is (so a task that restarts between start and wait does not start it twice)."""
        handle = SliceHandle.from_dict(handle)
        if job.hosts != (0,):
            raise ValueError(
                f"job {job.name}: hosts={list(job.hosts)} but a local slice has one host (0); "
                "jobs on several hosts need the cloud_tpu backend"
            )
        state = self.slice_state(handle)
        if state is not SliceState.READY:
            raise RuntimeError(f"slice {handle.name} is {state.value}, not READY")
        status_dir = os.path.join(handle.root, "jobs", job.name)
        job_handle = JobHandle.submitted(self.name, job, handle, status_dir)
        spec_path = os.path.join(status_dir, jobstatus.SPEC)
        running = jobstatus.running_handle(spec_path, self.job_state)
        if running is not None:
            log.info("job %s already running on %s", job.name, handle.name)
            return running
        if jobstatus.read_json(spec_path) is not None:
            self._archive(status_dir)
        os.makedirs(status_dir, exist_ok=True)
        command = [*self.entrypoint, *job.argv]
        jobstatus.write_json(
            spec_path, {"job": job.to_dict(), "command": command, "handle": job_handle.to_dict()}
        )
        interval = self.heartbeat_interval_s or heartbeat_interval(job.heartbeat_timeout_s)
        env = {**os.environ, **job.env}
        if job.run_root:
            env.setdefault("RLAX_RUN_ROOT", job.run_root)
        runner = runner_argv(status_dir, command, interval)
        with open(os.path.join(status_dir, "runner.log"), "ab") as runner_log:
            proc = subprocess.Popen(
                runner,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=runner_log,
                stderr=runner_log,
                start_new_session=True,  # its own process group: stop/teardown kill the group
                cwd=os.getcwd(),
            )
        # reap it when it ends (no zombie while this process lives); state comes from files
        threading.Thread(target=proc.wait, name=f"reap-{job.name}", daemon=True).start()
        # wait until the runner has registered, so that a stop right after start finds it
        runner_path = os.path.join(status_dir, jobstatus.RUNNER)
        deadline = time.monotonic() + 60.0
        while not os.path.exists(runner_path) and proc.poll() is None:
            if time.monotonic() > deadline:
                log.warning("runner of job %s has not registered after 60s", job.name)
                break
            time.sleep(0.02)
        log.info("started job %s on local slice %s: %s", job.name, handle.name, command)
        return job_handle

    def job_state(self, job: JobHandle | dict) -> JobStatus:
        job = JobHandle.from_dict(job)
        status = jobstatus.read_job_status(
            job.status_dir, job.heartbeat_timeout_s, job.submitted_at
        )
        if status.state is JobState.RUNNING:
            slice_state = self.slice_state(job.slice_handle)
            if slice_state is not SliceState.READY:
                return JobStatus(JobState.PREEMPTED, f"slice {slice_state.value.lower()}")
        return status

    def stop_job(self, job: JobHandle | dict) -> None:
        job = JobHandle.from_dict(job)
        self._kill(job.status_dir, mark_stop=True)

    # ------------------------------------------------------------------ helpers
    def _kill(self, status_dir: str, mark_stop: bool) -> None:
        """SIGTERM the job's process group, SIGKILL it after the grace period."""
        if mark_stop:
            jobstatus.write_json(os.path.join(status_dir, jobstatus.STOP), {"time": time.time()})
        runner = jobstatus.read_json(os.path.join(status_dir, jobstatus.RUNNER))
        if runner is None or runner.get("host") != socket.gethostname():
            return
        pgid = int(runner["pid"])
        for sig in (signal.SIGCONT, signal.SIGTERM):
            if not _signal_group(pgid, sig):
                return
        deadline = time.monotonic() + self.stop_grace_s
        while time.monotonic() < deadline:
            if not _group_alive(pgid):
                return
            time.sleep(0.05)
        _signal_group(pgid, signal.SIGKILL)

    def _archive(self, status_dir: str) -> None:
        n = 1
        while os.path.exists(f"{status_dir}.{n}"):
            n += 1
        os.replace(status_dir, f"{status_dir}.{n}")


def _signal_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False
