"""`rlax run --backend ray`: the run's jobs on a compute backend's slices, under the
Supervisor's interface (``add``, ``poll``, ``stop``, ``log_path``, ``components``).

``run_slices`` says which slices a run takes (the trainer's hosts as one slice; cpu workers on
slices of their own, gpu workers on their host of the trainer slice, whose bundles are whole
nodes so that device indices never collide) and where each job runs on them. ``SliceSupervisor``
provisions those slices, starts each component as a backend job, and restarts it as the local
supervisor would: a job whose slice lost a host (PREEMPTED) once the backend has placed the
slice again, a failed one unless it failed for the user (exit 2) or twice the same way without
progress. Each job's output is linked at ``logs/<name>.log`` (its first host's)."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from rlax_tasks.compute import (
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    SliceSpec,
    SliceState,
    jobstatus,
)
from rlax_tasks.compute.ray_cluster import slice_shape
from rlax_tasks.compute.types import RUN_ID_LABEL, slice_name
from rlax_tasks.plan.placement import COLOCATED, host_devices, is_colocated
from rlax_tasks.plan.topology import TRAINER_SLICE, WorkerSlices, worker_place, worker_slice
from rlax_tasks.run.supervisor import (
    JOB_NAME_ENV,
    Component,
    ComponentFailed,
    error_detail,
    error_line,
    judge_restart,
)

log = logging.getLogger(__name__)

SLICE_READY_TIMEOUT_S = 600.0  # a slice the cluster cannot place within this is an error
_STATUS_EVERY_S = 30.0  # how often a wait for a slice says so


@dataclasses.dataclass(frozen=True)
class RunSlices:
    """The slices of a run on a backend ({role: accelerator type}, the trainer's first) and the
    workers' own slices (None: the workers run on the trainer slice)."""

    types: dict[str, str]
    workers: WorkerSlices | None


def host_kind(cfg: Any) -> str:
    """What one host's bundle holds: ``cpu``, or ``gpu-N`` with N the GPUs its jobs name
    (the highest index of placement.trainer / placement.workers, plus one)."""
    p = cfg.placement
    if p.platform == "tpu":
        raise ValueError(
            "placement.platform: tpu: `rlax run --backend ray` places GPU and CPU hosts; run TPU "
            "slices with the rlax_train DAG (accelerator_type: a Cloud TPU type, on ray or "
            "cloud_tpu)"
        )
    if p.platform != "gpu":
        return "cpu"
    lists = [x for x in (p.trainer, *(p.workers or ())) if x is not None]
    return f"gpu-{max((max(x) for x in lists), default=0) + 1}"


def run_slices(cfg: Any) -> RunSlices:
    """The slices `rlax run` takes on a slice backend for ``cfg`` (see the module docstring);
    ValueError naming the field when the run cannot take slices."""
    if not re.fullmatch(r"[a-z0-9_-]{1,63}", cfg.run_id):
        raise ValueError(
            f"run_id: {cfg.run_id!r} labels the run's slices: use lowercase letters, digits, "
            "'_' and '-' (give --run-id)"
        )
    kind = host_kind(cfg)
    hosts = cfg.trainer.hosts
    types = {TRAINER_SLICE: kind if hosts == 1 else f"{hosts}x{kind}"}
    if is_colocated(cfg) or kind != "cpu" or cfg.placement.hosts > 1:
        return RunSlices(types, None)
    layout = WorkerSlices(cfg.workers.count, 1)
    types.update({worker_slice(i): "cpu" for i in range(layout.count)})
    return RunSlices(types, layout)


def node_plan(cfg: Any) -> list[str]:
    """One line per host of the run's slices (a Ray node each): what runs there, on which
    devices (`rlax run --backend ray --dry-run`)."""
    slices = run_slices(cfg)
    jobs: dict[tuple[str, int], list[str]] = {
        (role, h): [] for role, kind in slices.types.items() for h in range(slice_shape(kind).hosts)
    }
    main = COLOCATED if is_colocated(cfg) else "trainer"
    for h in range(cfg.trainer.hosts):
        jobs[TRAINER_SLICE, h].append(
            f"{main} (host {h} of {cfg.trainer.hosts}, {host_devices(cfg, main)})"
        )
    if not is_colocated(cfg):
        jobs[TRAINER_SLICE, 0] += ["ps (cpu)", "controller (cpu)"]
        for i in range(cfg.workers.count):
            role, (host,) = worker_place(cfg, i, slices.workers)
            jobs[role, host].append(f"worker-{i} ({host_devices(cfg, f'worker-{i}')})")
    return [
        f"slice {role} ({slices.types[role]}) host {h}: " + ", ".join(names)
        for (role, h), names in jobs.items()
    ]


@dataclasses.dataclass
class _Job:
    """A component as a backend job: where it runs and its current attempt."""

    component: Component
    slice: str
    hosts: tuple[int, ...]
    handle: JobHandle | None = None
    stopped: bool = False  # stopped by this supervisor: its end is not a failure


class SliceSupervisor:
    """Runs components as jobs on a backend's slices (see the module docstring).

    ``backend``: a ``rlax_tasks.compute`` backend; ``slices``: {role: accelerator type};
    ``progress``: how far the run is (a failure repeated without progress stops it)."""

    def __init__(
        self,
        backend: Any,
        run_id: str,
        log_dir: str,
        slices: dict[str, str],
        run_root: str = "",
        progress: Callable[[], Any] | None = None,
        max_restarts: int = 50,
        poll_interval_s: float = 1.0,
    ) -> None:
        self.backend, self.run_id, self.log_dir = backend, run_id, log_dir
        self.run_root = run_root
        self.slice_types = dict(slices)
        self.progress = progress
        self.max_restarts, self.poll_interval_s = max_restarts, poll_interval_s
        self.components: dict[str, Component] = {}
        self._jobs: dict[str, _Job] = {}
        self._slices: dict[str, Any] = {}  # role → SliceHandle
        self._finished: dict[str, int] = {}
        self._polled = 0.0
        os.makedirs(log_dir, exist_ok=True)

    # ------------------------------------------------------------------ slices
    def provision(self, timeout_s: float = SLICE_READY_TIMEOUT_S) -> None:
        """Creates every slice of the run (those an earlier `rlax run` of it left are torn down
        first) and waits until the backend has placed them all; ValueError when it cannot within
        ``timeout_s``."""
        labels = {RUN_ID_LABEL: self.run_id}
        # what an earlier `rlax run` of this run left (killed without stopping its jobs) is torn
        # down: the resume starts every job afresh from the run's files, with this run's token
        for handle in self.backend.list_slices(labels):
            log.warning("slice %s of an earlier rlax run of %s: tearing it down", handle.name,
                        self.run_id)  # fmt: skip
            self.backend.teardown(handle)
        for role, kind in self.slice_types.items():
            spec = SliceSpec(name=slice_name(self.run_id, role), accelerator_type=kind,
                             labels=labels)  # fmt: skip
            self._slices[role] = self.backend.provision(spec)
        for role in self.slice_types:
            self._wait_ready(role, timeout_s)

    def _wait_ready(self, role: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        said = 0.0
        while (state := self._slice_state(role)) is not SliceState.READY:
            if time.monotonic() > deadline:
                raise ValueError(
                    f"slice {role} ({self.slice_types[role]}): the cluster did not place it "
                    f"within {timeout_s:.0f} s (still {state.value}): check that its nodes have "
                    "the resources free (`ray status`)"
                )
            if time.monotonic() - said >= _STATUS_EVERY_S:
                said = time.monotonic()
                log.info("waiting for slice %s (%s): %s", role, self.slice_types[role], state)
            time.sleep(0.5)

    def _slice_state(self, role: str) -> SliceState:
        """The slice's state; a slice that is gone is provisioned again."""
        state = self.backend.slice_state(self._slices[role])
        if state in (SliceState.DELETED, SliceState.FAILED, SliceState.PREEMPTED):
            log.warning("slice %s is %s: provisioning it again", role, state.value)
            spec = SliceSpec.from_dict(self._slices[role].spec)
            self._slices[role] = self.backend.provision(spec)
            state = self.backend.slice_state(self._slices[role])
        return state

    # ------------------------------------------------------------------ jobs
    def log_path(self, name: str) -> str:
        """``logs/<name>.log``: a link to the output of the job's current attempt (host 0)."""
        return os.path.join(self.log_dir, f"{name}.log")

    def job_handle(self, name: str) -> JobHandle | None:
        """The backend's handle of a component's current attempt (None while it waits)."""
        return self._jobs[name].handle

    def add(
        self, component: Component, slice: str = TRAINER_SLICE, hosts: Sequence[int] = (0,)
    ) -> Component:
        """Starts ``component`` as a job on ``hosts`` of slice ``slice``."""
        if slice not in self._slices:
            raise ValueError(f"{component.name}: no slice {slice!r} in this run")
        job = _Job(component, slice, tuple(hosts))
        self.components[component.name] = component
        self._jobs[component.name] = job
        self._finished.pop(component.name, None)
        self._start(job)
        return component

    def _start(self, job: _Job) -> bool:
        """Starts the job's next attempt if its slice is placed; False while it is not."""
        if self._slice_state(job.slice) is not SliceState.READY:
            return False
        c = job.component
        spec = JobSpec(
            name=c.name,
            argv=c.argv,
            env={JOB_NAME_ENV: c.name, **c.env},
            run_root=self.run_root,
            hosts=job.hosts,
        )
        job.handle = self.backend.start_job(self._slices[job.slice], spec)
        job.stopped = False
        c.started_at = time.monotonic()
        self._link_logs(job)
        log.info("started %s on slice %s, hosts %s", c.name, job.slice, list(job.hosts))
        return True

    def _link_logs(self, job: _Job) -> None:
        """``logs/<name>.log`` (and ``<name>-host<K>.log``) → the attempt's stderr of each host."""
        for index, host in enumerate(job.hosts):
            name = job.component.name if index == 0 else f"{job.component.name}-host{index}"
            target = os.path.join(
                jobstatus.host_status_dir(job.handle.status_dir, host), jobstatus.STDERR
            )
            link = os.path.join(self.log_dir, f"{name}.log")
            if os.path.lexists(link):
                os.remove(link)
            os.symlink(target, link)

    def poll(self) -> dict[str, int]:
        """Restarts ended restartable jobs; returns {name: 0} of the finished ones. Raises
        ComponentFailed for a failure that restarting will not fix."""
        if time.monotonic() - self._polled < self.poll_interval_s:
            return dict(self._finished)
        self._polled = time.monotonic()
        for name, job in self._jobs.items():
            if name in self._finished or job.stopped:
                continue
            if job.handle is None:  # waiting for its slice to be placed again
                self._start(job)
                continue
            status = self.backend.job_state(job.handle)
            if status.state is JobState.RUNNING:
                continue
            if status.state is JobState.SUCCEEDED and not job.component.restart:
                self._finished[name] = 0
                continue
            self._judge(job, status)
            job.component.restarts += 1
            job.handle = None
            log.warning(
                "%s ended (%s: %s): restarting it (restart %d)",
                name,
                status.state.value,
                status.message,
                job.component.restarts,
            )
            if not self._start(job):
                log.warning("%s: waiting for slice %s to be placed again", name, job.slice)
        return dict(self._finished)

    def _judge(self, job: _Job, status: JobStatus) -> None:
        """Raises ComponentFailed when restarting the job (ended with ``status``) will not help."""
        c = job.component
        path = self.log_path(c.name)
        line = error_line(path) if status.state is JobState.FAILED else ""
        detail = error_detail(line) or status.message
        if status.state is JobState.FAILED and status.is_config_error:
            raise ComponentFailed(c.name, f"{c.name} failed: {detail} (log: {path})")
        # (line is "" unless it FAILED: preempted, or exited 0, is not a streak)
        judge_restart(c, line, detail, path, self.max_restarts, self.progress)

    def stop(self, names: Sequence[str] | None = None, timeout_s: float = 10.0) -> None:
        """Stops the named jobs (every one when None, then tears the run's slices down)."""
        del timeout_s  # the backend's own stop_grace_s applies
        for name in names or list(self._jobs):
            job = self._jobs[name]
            if job.handle is not None and not job.stopped:
                job.stopped = True
                try:
                    self.backend.stop_job(job.handle)
                except Exception as e:  # noqa: BLE001 - stopping the rest matters more
                    log.warning("stopping %s: %s", name, e)
        if names is None:
            for role, handle in self._slices.items():
                try:
                    self.backend.teardown(handle)
                except Exception as e:  # noqa: BLE001 - tearing down the rest matters more
                    log.warning("tearing down slice %s: %s", role, e)
            self._slices.clear()
