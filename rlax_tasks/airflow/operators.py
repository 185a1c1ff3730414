"""Airflow operators that provision slices, run `rlax` jobs on them, and tear them down.

Backends are named (``"local"``, ``"cloud_tpu"``) with JSON settings, so tasks and triggers
rebuild them anywhere (``rlax_tasks.compute.get_backend``). A retry re-provisions a lost slice
(idempotent by name) and starts the job again: RLAX components resume by themselves."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import (
    AirflowFailException,
    AirflowRescheduleException,
    AirflowSkipException,
)

from rlax_tasks.airflow.compute_connection import compute_backend
from rlax_tasks.airflow.job_outcome import (
    SliceUnavailableError,
    failed_sibling_tasks,
    job_name_for,
    raise_for_job_event,
)
from rlax_tasks.airflow.triggers import JobStateTrigger, SliceReadyTrigger
from rlax_tasks.compute import (
    JobSpec,
    JobState,
    SliceHandle,
    SliceSpec,
    SliceState,
    get_backend,
)
from rlax_tasks.plan.run_plan import Job, PlanFormatError
from rlax_tasks.rundir import storage

log = logging.getLogger(__name__)


def _as_handle_dict(value: Any, field: str) -> dict[str, Any]:
    """A slice handle as a dict, from a dict, a SliceHandle, or its JSON (rendered template)."""
    if isinstance(value, SliceHandle):
        return value.to_dict()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise AirflowFailException(f"{field} is not a slice handle: {value[:200]!r}") from None
    if not isinstance(value, dict):
        raise AirflowFailException(f"{field} must be a slice handle dict, got {type(value)}")
    return value


def _raise_unless_ready(event: dict[str, Any]) -> None:
    """A SliceReadyTrigger event (or its in-process twin) for a slice that is not READY raises
    the retryable SliceUnavailableError."""
    if event["state"] != SliceState.READY.value:
        raise SliceUnavailableError(
            f"slice {event['slice']['name']} is {event['state']}: {event.get('message', '')}"
        )


class _BackendOperator(BaseOperator):
    """Shared: a named backend with settings, rebuilt wherever the task runs. The settings are
    a template field: the DAG's run root (their slices' control directory) comes from the run's
    plan (an XComArg), not from the environment the DAG file was parsed in.

    Args:
        backend: ``local``, ``cloud_tpu`` or ``ray``; None: the compute Connection's, found
            when the task runs (``backend_settings`` then needs a ``run_root``).
        backend_settings: the backend's settings (``rlax_tasks.compute.get_backend``).
        deferrable: wait in the triggerer (True) or poll in the task's process.
        poll_interval_s: how often a slice or job is checked.
        **kwargs: BaseOperator's (``task_id``, ``retries``, ...).
    """

    def __init__(
        self,
        *,
        backend: str | None = "local",
        backend_settings: dict[str, Any] | None = None,
        deferrable: bool = True,
        poll_interval_s: float = 10.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.backend = backend
        self.backend_settings = dict(backend_settings or {})
        self.deferrable = deferrable
        self.poll_interval_s = float(poll_interval_s)

    def _resolved(self) -> tuple[str, dict[str, Any]]:
        """(backend name, settings) this task runs with (its triggers are given the same)."""
        if self.backend is not None:
            return self.backend, self.backend_settings
        if "run_root" not in self.backend_settings:
            raise AirflowFailException(f"{self.task_id}: backend_settings needs a run_root")
        return compute_backend(self.backend_settings["run_root"])

    def _backend(self):  # noqa: ANN202 - rlax_tasks.compute.Backend
        try:
            name, settings = self._resolved()
            return get_backend(name, **settings)
        except (ValueError, TypeError) as e:  # PlanError (a Connection's field) is a ValueError
            raise AirflowFailException(f"{self.task_id}: backend configuration: {e}") from None

    def _defer_on_slice(self, handle: dict[str, Any], method_name: str) -> None:
        """Defers to SliceReadyTrigger until ``handle`` leaves PROVISIONING, then resumes in
        ``method_name`` (each subclass sets ``provision_timeout_s``)."""
        self.defer(
            trigger=SliceReadyTrigger(
                *self._resolved(), handle, poll_interval_s=self.poll_interval_s
            ),
            method_name=method_name,
            timeout=timedelta(seconds=self.provision_timeout_s),
        )

    def _resume_when_ready(
        self, context: Any, backend: Any, handle: dict[str, Any], method_name: str
    ) -> Any:
        """Resumes in ``method_name`` once a PROVISIONING slice is ready: deferred to the
        triggerer, or polled in-process when the operator is not deferrable."""
        if self.deferrable:
            self._defer_on_slice(handle, method_name)
        event = self._wait_slice(backend, handle, self.provision_timeout_s)
        return getattr(self, method_name)(context, event)

    def _wait_slice(self, backend: Any, handle: dict[str, Any], timeout_s: float) -> dict:
        """Polls in-process until the slice leaves PROVISIONING (non-deferrable mode)."""
        deadline = time.monotonic() + timeout_s
        while (state := backend.slice_state(handle)) is SliceState.PROVISIONING:
            if time.monotonic() > deadline:
                raise SliceUnavailableError(f"slice {handle['name']} not ready after {timeout_s}s")
            time.sleep(self.poll_interval_s)
        return {"state": state.value, "message": f"slice {state.value}", "slice": handle}


# a slice's own fields, as the provisioning operators take them (SliceSpec's, less spot and labels)
_REQUIRED_SLICE_FIELDS = ("name", "accelerator_type")
_OPTIONAL_SLICE_FIELDS = (
    "runtime_version", "reserved", "service_account", "network", "subnetwork", "zone", "project",
)  # fmt: skip


def _slice_spec(fields: dict[str, Any], spot: bool, labels: dict[str, str]) -> SliceSpec:
    """A SliceSpec from a slice's fields (an optional one missing or empty: SliceSpec's default);
    ``spot`` unless the slice names its own capacity. KeyError: no name or accelerator type."""
    optional = {f: fields[f] for f in _OPTIONAL_SLICE_FIELDS if fields.get(f) not in (None, "")}
    return SliceSpec(
        name=fields["name"], accelerator_type=fields["accelerator_type"],
        spot=fields.get("spot", spot), labels=dict(labels), **optional,
    )  # fmt: skip


class ProvisionSliceOperator(_BackendOperator):
    """Provisions one slice (idempotent by name) and returns its handle dict once READY.

    Args:
        name: the slice's name (a template or XComArg).
        accelerator_type: its type (``cpu``, ``v5litepod-8``, ``gpu-8``, ...).
        runtime_version: its image ("": the family's default; none on the local backend).
        spot: reclaimable capacity; ``reserved``: the project's reservation (neither:
            on-demand).
        reserved: see ``spot``.
        service_account: the identity its VMs run as ("": the default).
        network: the VPC network ("": the default); ``subnetwork`` its subnetwork.
        subnetwork: see ``network``.
        labels: the slice's labels (the janitor finds a run's slices by them).
        zone: the zone ("": the backend's); ``project`` the project ("": the backend's).
        project: see ``zone``.
        provision_timeout_s: how long it may stay PROVISIONING.
        **kwargs: ``_BackendOperator``'s.

    Returns:
        (``execute``) the slice's handle dict.
    """

    template_fields = (
        "name", "accelerator_type", "runtime_version", "labels", "zone", "project",
        "service_account", "network", "subnetwork", "backend_settings",
    )  # fmt: skip

    def __init__(
        self,
        *,
        name: str,
        accelerator_type: str = "cpu",
        runtime_version: str = "",
        spot: bool = True,
        reserved: bool = False,
        service_account: str = "",
        network: str = "",
        subnetwork: str = "",
        labels: dict[str, str] | None = None,
        zone: str = "",
        project: str = "",
        provision_timeout_s: float = 3600.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("poll_interval_s", 15.0)
        super().__init__(**kwargs)
        self.name = name
        self.accelerator_type = accelerator_type
        self.runtime_version = runtime_version
        self.spot, self.reserved = spot, reserved
        self.service_account = service_account
        self.network, self.subnetwork = network, subnetwork
        self.labels = labels or {}
        self.zone, self.project = zone, project
        self.provision_timeout_s = float(provision_timeout_s)

    def execute(self, context: Any) -> dict[str, Any]:
        backend = self._backend()
        try:
            names = _REQUIRED_SLICE_FIELDS + _OPTIONAL_SLICE_FIELDS
            fields = {f: getattr(self, f) for f in names}
            handle = backend.provision(_slice_spec(fields, self.spot, self.labels)).to_dict()
        except (ValueError, FileNotFoundError) as e:
            raise AirflowFailException(f"{self.task_id}: {e}") from None
        state = backend.slice_state(handle)
        if state is SliceState.PROVISIONING:
            return self._resume_when_ready(context, backend, handle, "execute_complete")
        return self.execute_complete(
            context, {"state": state.value, "message": f"slice {state.value}", "slice": handle}
        )

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        _raise_unless_ready(event)
        self.log.info("slice %s READY", event["slice"]["name"])
        return event["slice"]


class ProvisionSlicesOperator(_BackendOperator):
    """Provisions the slices of a run at once (idempotent by name); a slice that fails fails
    the task (retryable).

    Args:
        slices: [{"role", "name", "accelerator_type", "runtime_version", ...}]: a
            TrainingPlan's ``slices`` (``SlicePlan.to_dict``), an XComArg of the plan.
        spot: the capacity of a slice that names none.
        labels: every slice's labels.
        provision_timeout_s: how long a slice may stay PROVISIONING.
        **kwargs: ``_BackendOperator``'s.

    Returns:
        (``execute``) ``{role: handle dict, ..., "all": [handle dicts], "evaluation": handle
        dict}`` (``multiple_outputs``: each role an XCom key; ``evaluation``: the slice marked
        ``"evaluation": true``, else the first).
    """

    template_fields = ("slices", "labels", "backend_settings")

    def __init__(
        self,
        *,
        slices: Any,
        spot: bool = True,
        labels: dict[str, str] | None = None,
        provision_timeout_s: float = 3600.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("poll_interval_s", 15.0)
        kwargs.setdefault("multiple_outputs", True)
        super().__init__(**kwargs)
        self.slices = slices
        self.spot = spot
        self.labels = labels or {}
        self.provision_timeout_s = float(provision_timeout_s)

    def execute(self, context: Any) -> dict[str, Any]:
        backend = self._backend()
        slices = json.loads(self.slices) if isinstance(self.slices, str) else list(self.slices)
        handles = {}
        for s in slices:
            try:
                spec = _slice_spec(s, self.spot, self.labels)
                handles[s["role"]] = backend.provision(spec).to_dict()
            except (ValueError, FileNotFoundError, KeyError) as e:
                raise AirflowFailException(f"{self.task_id}: slice {s!r}: {e}") from None
        out = self._wait(context, backend, handles)
        marked = [handles[s["role"]] for s in slices if s.get("evaluation")]
        return {**out, "evaluation": (marked or out["all"])[0]}

    def _wait(self, context: Any, backend: Any, handles: dict[str, dict]) -> dict[str, Any]:
        """Defers on the first slice still PROVISIONING until none is; fails on a lost one."""
        for handle in handles.values():
            state = backend.slice_state(handle)
            if state is SliceState.PROVISIONING:
                self.log.info("slice %s PROVISIONING", handle["name"])
                if self.deferrable:
                    self._defer_on_slice(handle, "execute_complete")
                state = SliceState(
                    self._wait_slice(backend, handle, self.provision_timeout_s)["state"]
                )
            if state is not SliceState.READY:
                raise SliceUnavailableError(f"slice {handle['name']} is {state.value}")
        self.log.info("slices READY: %s", ", ".join(h["name"] for h in handles.values()))
        return {**handles, "all": list(handles.values())}

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """Resumes after one slice became READY: the handles again (provisioning is idempotent
        by name), waiting on the next slice still PROVISIONING."""
        _raise_unless_ready(event)
        return self.execute(context)


def start_jobs(
    backend_name: str,
    backend_settings: dict[str, Any],
    slice_handle: Any,
    jobs: dict[str, list[str]],
    env: dict[str, str] | None = None,
    heartbeat_timeout_s: float = 120.0,
    hosts: Any = (0,),
) -> dict[str, dict[str, Any]]:
    """Starts every job of a run on a READY slice at once (idempotent: a running job is left
    alone), each on ``hosts`` of the slice, and returns {job name: job handle dict} for the
    watching RlaxJobOperators (``started_jobs=``). A slice that is not READY starts nothing:
    each job's own task provisions and starts it then."""
    backend = get_backend(backend_name, **backend_settings)
    handle = _as_handle_dict(slice_handle, "slice_handle")
    if backend.slice_state(handle) is not SliceState.READY:
        return {}
    started = {}
    for name, argv in jobs.items():
        spec = JobSpec(
            name=name,
            argv=list(argv),
            env={str(k): str(v) for k, v in (env or {}).items()},
            heartbeat_timeout_s=heartbeat_timeout_s,
            hosts=tuple(hosts),
        )
        started[name] = backend.start_job(handle, spec).to_dict()
    return started


class RlaxJobOperator(_BackendOperator):
    """Runs ``rlax <argv>`` on a slice until it ends. PREEMPTED raises ``JobPreemptedError``,
    other failures ``JobFailedError`` (retryable), exit 2 ``AirflowFailException``.

    Args:
        slice_handle: the slice's handle dict (an XComArg of the provisioning task).
        argv: the `rlax` command line; empty: the task is skipped (no such job in this run).
        env: the job's environment.
        hosts: the slice's hosts the job spans.
        job: a planned job (a TrainingPlan's ``Job.to_dict``, e.g. ``plan["trainer"]``) whose
            argv, env and hosts replace the three above.
        job_name: the job's name (default: from the task id and map index).
        run_root: the job's run root, for the backend's job files.
        heartbeat_timeout_s: a job silent this long is lost.
        provision_timeout_s: how long a re-provisioned slice may stay PROVISIONING.
        started_jobs: {job name: handle} of ``start_jobs``: the job may already run (taken as
            is on the first try).
        done_when: the job among ``started_jobs`` whose success ends this watch too.
        sibling_grace_s: how long a lost sibling may take to come back before this job fails.
        done_marker: a file whose presence ends the watch (the run is complete).
        **kwargs: ``_BackendOperator``'s.

    Returns:
        (``execute``) ``{"job", "exit_code", "message"}``.
    """

    template_fields = (
        "slice_handle", "argv", "env", "job_name", "run_root", "started_jobs", "hosts",
        "done_marker", "backend_settings", "job",
    )  # fmt: skip

    def __init__(
        self,
        *,
        slice_handle: Any,
        argv: Any = None,
        env: dict[str, str] | None = None,
        hosts: Any = (0,),
        job_name: str | None = None,
        run_root: str = "",
        heartbeat_timeout_s: float = 120.0,
        provision_timeout_s: float = 3600.0,
        started_jobs: Any = None,
        done_when: str | None = None,
        sibling_grace_s: float = 600.0,
        done_marker: str | None = None,
        job: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.slice_handle = slice_handle
        self.argv = argv
        self.env = env or {}
        self.hosts = hosts  # the slice's hosts the job runs on (a list, or an XComArg)
        self.job = job
        self.job_name = job_name
        self.run_root = run_root
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self.provision_timeout_s = float(provision_timeout_s)
        self.started_jobs = started_jobs
        self.done_when = done_when
        self.sibling_grace_s = float(sibling_grace_s)
        self.done_marker = done_marker

    def _started(self) -> dict[str, dict[str, Any]]:
        jobs = self.started_jobs or {}
        if isinstance(jobs, str):
            jobs = json.loads(jobs)
        return dict(jobs)

    def _take_planned_job(self) -> None:
        """argv, env and hosts from ``job`` (rendered: a planned Job's dict), where given."""
        if self.job is None:
            return
        raw = json.loads(self.job) if isinstance(self.job, str) else self.job
        try:
            planned = Job.from_dict(raw, f"{self.task_id}: job")
        except PlanFormatError as e:
            raise AirflowFailException(str(e)) from None
        self.argv, self.env, self.hosts = planned.argv, planned.env, list(planned.hosts)

    def execute(self, context: Any) -> dict[str, Any]:
        self._take_planned_job()
        if not self.argv:  # the plan has no such job (a colocated run is the controller's one)
            raise AirflowSkipException(f"{self.task_id}: this run has no {self.task_id} job")
        backend = self._backend()
        ti = context.get("ti") if hasattr(context, "get") else None
        own = self._started().get(self._job_spec(context).name)
        if self.done_marker and storage.exists(self.done_marker):
            # the run is complete (a retry or reschedule after `finish` stopped the services):
            # nothing to start again
            if own is not None:
                backend.stop_job(own)
            self.log.info("%s exists: the run is complete, not starting the job", self.done_marker)
            return {"job": own, "exit_code": None, "message": "the run is complete"}
        if own is not None and getattr(ti, "try_number", 1) <= 1:
            status = backend.job_state(own)
            if status.state is JobState.RUNNING:
                return self._watch(context, backend, own)
            # it ended before this task first looked: report it (exit 2 must not be retried)
            return self.execute_complete(context, {**status.to_dict(), "job": own})
        handle = _as_handle_dict(self.slice_handle, "slice_handle")
        state = backend.slice_state(handle)
        if state not in (SliceState.READY, SliceState.PROVISIONING):
            # preempted / failed / re-created since: provision by name (idempotent, so the
            # jobs sharing this slice end up on the same new slice)
            self.log.warning("slice %s is %s: provisioning it again", handle["name"], state.value)
            try:
                handle = backend.provision(SliceHandle.from_dict(handle).slice_spec).to_dict()
            except (ValueError, FileNotFoundError) as e:
                raise AirflowFailException(f"{self.task_id}: {e}") from None
            state = backend.slice_state(handle)
        if state is SliceState.PROVISIONING:
            return self._resume_when_ready(context, backend, handle, "start_on_ready_slice")
        return self._start(context, backend, handle)

    def start_on_ready_slice(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """Resumes after SliceReadyTrigger: starts the job on the (re-)provisioned slice."""
        _raise_unless_ready(event)
        return self._start(context, self._backend(), event["slice"])

    def _job_spec(self, context: Any) -> JobSpec:
        self._take_planned_job()
        ti = context.get("ti") if hasattr(context, "get") else None
        map_index = getattr(ti, "map_index", -1) if ti is not None else -1
        argv = self.argv
        if isinstance(argv, str):
            argv = json.loads(argv) if argv.startswith("[") else argv.split()
        try:
            return JobSpec(
                name=self.job_name or job_name_for(self.task_id, map_index),
                argv=list(argv),
                env={str(k): str(v) for k, v in (self.env or {}).items()},
                run_root=self.run_root,
                heartbeat_timeout_s=self.heartbeat_timeout_s,
                hosts=tuple(json.loads(hosts) if isinstance(hosts := self.hosts, str) else hosts),
            )
        except ValueError as e:
            raise AirflowFailException(f"{self.task_id}: {e}") from None

    def _start(self, context: Any, backend: Any, handle: dict[str, Any]) -> dict[str, Any]:
        spec = self._job_spec(context)
        job = backend.start_job(handle, spec).to_dict()
        self.log.info("job %s running on slice %s: rlax %s", spec.name, handle["name"], spec.argv)
        return self._watch(context, backend, job)

    def _watch(self, context: Any, backend: Any, job: dict[str, Any]) -> dict[str, Any]:
        started = self._started()
        done_when = started.get(self.done_when) if self.done_when else None
        if done_when is not None and done_when.get("name") == job["name"]:
            done_when = None
        siblings = [h for name, h in started.items() if name != job["name"]]
        trigger = JobStateTrigger(
            *self._resolved(),
            job,
            poll_interval_s=self.poll_interval_s,
            done_when=done_when,
            siblings=siblings,
            sibling_grace_s=self.sibling_grace_s,
            done_marker=self.done_marker,
        )
        if self.deferrable:
            self.defer(trigger=trigger, method_name="execute_complete")
        while (event := trigger._observe(backend)) is None:
            time.sleep(self.poll_interval_s)
        return self.execute_complete(context, event)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """Resumes after JobStateTrigger: success returns, failures raise (see the docstring)."""
        if event.get("state") == "DONE":
            self._backend().stop_job(event["job"])
            self.log.info("job %s stopped: %s", event["job"]["name"], event["message"])
            return {"job": event["job"], "exit_code": None, "message": event["message"]}
        if event.get("state") == "SIBLING_LOST":
            siblings = [name for name in self._started() if name != event["job"].get("name")]
            if failed := failed_sibling_tasks(context, siblings):
                # nobody will restart it: waiting would hold the run (and its slices) forever
                self._backend().stop_job(event["job"])
                raise AirflowFailException(
                    f"{self.task_id}: {event['message']}, and task(s) {', '.join(failed)} of "
                    f"this run failed for good: stopped job {event['job'].get('name')} (clear "
                    "the failed tasks to run again)"
                )
            # give way without using a retry: the task comes back and watches its job again
            self.log.warning("%s; rescheduling so that its task can restart it", event["message"])
            raise AirflowRescheduleException(
                reschedule_date=datetime.now(UTC) + timedelta(seconds=self.poll_interval_s)
            )
        raise_for_job_event(event)
        self.log.info("job %s succeeded", event["job"]["name"])
        return {
            "job": event["job"],
            "exit_code": event.get("exit_code"),
            "message": event["message"],
        }


class TeardownSliceOperator(_BackendOperator):
    """Deletes a slice, or each of a list (idempotent); the DAG's teardown (trigger_rule
    "all_done" unless given).

    Args:
        slice_handle: a slice's handle dict or a list of them (an XComArg); empty: nothing
            was provisioned, nothing to delete.
        **kwargs: ``_BackendOperator``'s.
    """

    template_fields = ("slice_handle", "backend_settings")

    def __init__(self, *, slice_handle: Any, **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", "all_done")
        super().__init__(**kwargs)
        self.slice_handle = slice_handle

    def execute(self, context: Any) -> None:
        if not self.slice_handle:
            self.log.info("no slice handle (provisioning never succeeded): nothing to delete")
            return
        value = self.slice_handle
        if isinstance(value, str) and value.startswith("["):
            value = json.loads(value)
        backend = self._backend()
        for item in value if isinstance(value, list) else [value]:  # one handle, or a list
            handle = _as_handle_dict(item, "slice_handle")
            backend.teardown(handle)
            self.log.info("slice %s torn down", handle["name"])
