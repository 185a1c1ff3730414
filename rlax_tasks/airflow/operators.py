"""Airflow operators that provision slices, run `rlax` jobs on them, and tear them down.

```python
slice_ = ProvisionSliceOperator(task_id="provision", backend="local", backend_settings={...},
                                name="rlax-r1-main", accelerator_type="cpu", labels={...})
job = RlaxJobOperator(task_id="trainer", backend="local", backend_settings={...},
                      slice_handle=slice_.output, argv=["trainer", ...], env={...})
done = TeardownSliceOperator(task_id="teardown", backend="local", backend_settings={...},
                             slice_handle=slice_.output)       # trigger_rule="all_done"
```
- ``ProvisionSliceOperator`` returns the slice handle dict (XCom). While the slice is
  PROVISIONING it defers to ``SliceReadyTrigger`` (``deferrable=True``) or polls.
- ``RlaxJobOperator`` starts ``rlax <argv>`` on the slice and defers to ``JobStateTrigger``; it
  returns ``{"job": <job handle>, "exit_code": 0, "message"}`` when the job SUCCEEDED. A job
  that was PREEMPTED (slice reclaimed, process killed, heartbeat missing) raises
  ``JobPreemptedError`` and any other failure ``JobFailedError`` (both retryable
  ``AirflowException``s); a configuration error (`rlax` exit code 2) raises
  ``AirflowFailException`` (no retries). On a retry, a slice that is no longer usable is
  provisioned again from the spec in its handle (``backend.provision`` is idempotent by name,
  so jobs sharing a slice re-provision it once), and the job starts again: RLAX components
  resume from the newest checkpoint and controller snapshot by themselves.
- ``TeardownSliceOperator`` deletes the slice (idempotent; a missing handle is a no-op).

Backends are named (``"local"`` or ``"cloud_tpu"``) with JSON settings, so operators and
triggers rebuild them anywhere (see ``rlax_tasks.compute.get_backend``).
"""

from __future__ import annotations

import json
import re
import time
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from rlax_tasks.airflow.triggers import JobStateTrigger, SliceReadyTrigger
from rlax_tasks.compute import (
    JobSpec,
    JobState,
    SliceHandle,
    SliceSpec,
    SliceState,
    get_backend,
)
from rlax_tasks.compute.types import CONFIG_ERROR_EXIT_CODE


class JobPreemptedError(AirflowException):
    """The job or its slice was taken away; a retry resumes it (retryable)."""


class JobFailedError(AirflowException):
    """The job failed for a reason other than configuration (retryable)."""


class SliceUnavailableError(AirflowException):
    """The slice could not be provisioned or was lost (retryable)."""


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


def job_name_for(task_id: str, map_index: int = -1) -> str:
    """A valid job name (lowercase letters, digits, hyphens) for a task (and map index)."""
    name = re.sub(r"[^a-z0-9-]+", "-", task_id.lower()).strip("-") or "job"
    if not name[0].isalpha():
        name = "j-" + name
    suffix = f"-{map_index}" if map_index is not None and map_index >= 0 else ""
    return name[: 63 - len(suffix)].rstrip("-") + suffix


def raise_for_job_event(event: dict[str, Any]) -> None:
    """Maps a JobStateTrigger event to the task outcome: returns on success, else raises the
    retryable or non-retryable exception (see the module docstring)."""
    state, message = event.get("state"), event.get("message", "")
    name = event.get("job", {}).get("name", "?")
    if state == JobState.SUCCEEDED.value:
        return
    if state == JobState.FAILED.value and event.get("exit_code") == CONFIG_ERROR_EXIT_CODE:
        raise AirflowFailException(f"job {name}: {message} — fix the configuration; not retrying")
    if state == JobState.PREEMPTED.value:
        raise JobPreemptedError(f"job {name} preempted: {message}; the retry resumes it")
    raise JobFailedError(f"job {name} {str(state).lower()}: {message}")


class _BackendOperator(BaseOperator):
    """Shared: a named backend with settings, rebuilt wherever the task runs."""

    def __init__(
        self,
        *,
        backend: str = "local",
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

    def _backend(self):  # noqa: ANN202 - rlax_tasks.compute.Backend
        try:
            return get_backend(self.backend, **self.backend_settings)
        except (ValueError, TypeError) as e:
            raise AirflowFailException(f"{self.task_id}: backend configuration: {e}") from None

    def _wait_slice(self, backend: Any, handle: dict[str, Any], timeout_s: float) -> dict:
        """Polls in-process until the slice leaves PROVISIONING (non-deferrable mode)."""
        deadline = time.monotonic() + timeout_s
        while (state := backend.slice_state(handle)) is SliceState.PROVISIONING:
            if time.monotonic() > deadline:
                raise SliceUnavailableError(f"slice {handle['name']} not ready after {timeout_s}s")
            time.sleep(self.poll_interval_s)
        return {"state": state.value, "message": f"slice {state.value}", "slice": handle}


class ProvisionSliceOperator(_BackendOperator):
    """Provisions one slice (idempotent by name) and returns its handle dict once READY."""

    template_fields = ("name", "accelerator_type", "runtime_version", "labels", "zone", "project")

    def __init__(
        self,
        *,
        name: str,
        accelerator_type: str = "cpu",
        runtime_version: str = "",
        spot: bool = True,
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
        self.spot = spot
        self.labels = labels or {}
        self.zone, self.project = zone, project
        self.provision_timeout_s = float(provision_timeout_s)

    def execute(self, context: Any) -> dict[str, Any]:
        backend = self._backend()
        try:
            spec = SliceSpec(
                name=self.name,
                accelerator_type=self.accelerator_type,
                runtime_version=self.runtime_version,
                spot=self.spot,
                labels=dict(self.labels),
                zone=self.zone,
                project=self.project,
            )
            handle = backend.provision(spec).to_dict()
        except (ValueError, FileNotFoundError) as e:
            raise AirflowFailException(f"{self.task_id}: {e}") from None
        state = backend.slice_state(handle)
        if state is SliceState.PROVISIONING:
            if self.deferrable:
                self.defer(
                    trigger=SliceReadyTrigger(
                        self.backend, self.backend_settings, handle, self.poll_interval_s
                    ),
                    method_name="execute_complete",
                    timeout=timedelta(seconds=self.provision_timeout_s),
                )
            return self.execute_complete(
                context, self._wait_slice(backend, handle, self.provision_timeout_s)
            )
        return self.execute_complete(
            context, {"state": state.value, "message": f"slice {state.value}", "slice": handle}
        )

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        if event["state"] != SliceState.READY.value:
            raise SliceUnavailableError(
                f"slice {event['slice']['name']} is {event['state']}: {event.get('message', '')}"
            )
        self.log.info("slice %s READY", event["slice"]["name"])
        return event["slice"]


class RlaxJobOperator(_BackendOperator):
    """Runs ``rlax <argv>`` on a slice until it ends; see the module docstring for outcomes."""

    template_fields = ("slice_handle", "argv", "env", "job_name", "run_root")

    def __init__(
        self,
        *,
        slice_handle: Any,
        argv: list[str],
        env: dict[str, str] | None = None,
        job_name: str | None = None,
        run_root: str = "",
        heartbeat_timeout_s: float = 120.0,
        provision_timeout_s: float = 3600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.slice_handle = slice_handle
        self.argv = argv
        self.env = env or {}
        self.job_name = job_name
        self.run_root = run_root
        self.heartbeat_timeout_s = float(heartbeat_timeout_s)
        self.provision_timeout_s = float(provision_timeout_s)

    def execute(self, context: Any) -> dict[str, Any]:
        backend = self._backend()
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
            if self.deferrable:
                self.defer(
                    trigger=SliceReadyTrigger(
                        self.backend, self.backend_settings, handle, self.poll_interval_s
                    ),
                    method_name="start_on_ready_slice",
                    timeout=timedelta(seconds=self.provision_timeout_s),
                )
            return self.start_on_ready_slice(
                context, self._wait_slice(backend, handle, self.provision_timeout_s)
            )
        return self._start(context, backend, handle)

    def start_on_ready_slice(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """Resumes after SliceReadyTrigger: starts the job on the (re-)provisioned slice."""
        if event["state"] != SliceState.READY.value:
            raise SliceUnavailableError(
                f"slice {event['slice']['name']} is {event['state']}: {event.get('message', '')}"
            )
        return self._start(context, self._backend(), event["slice"])

    def _job_spec(self, context: Any) -> JobSpec:
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
            )
        except ValueError as e:
            raise AirflowFailException(f"{self.task_id}: {e}") from None

    def _start(self, context: Any, backend: Any, handle: dict[str, Any]) -> dict[str, Any]:
        spec = self._job_spec(context)
        job = backend.start_job(handle, spec).to_dict()
        self.log.info("job %s running on slice %s: rlax %s", spec.name, handle["name"], spec.argv)
        if self.deferrable:
            self.defer(
                trigger=JobStateTrigger(
                    self.backend, self.backend_settings, job, self.poll_interval_s
                ),
                method_name="execute_complete",
            )
        while (status := backend.job_state(job)).state is JobState.RUNNING:
            time.sleep(self.poll_interval_s)
        return self.execute_complete(context, {**status.to_dict(), "job": job})

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        """Resumes after JobStateTrigger: success returns, failures raise (see the docstring)."""
        raise_for_job_event(event)
        self.log.info("job %s succeeded", event["job"]["name"])
        return {
            "job": event["job"],
            "exit_code": event.get("exit_code"),
            "message": event["message"],
        }


class TeardownSliceOperator(_BackendOperator):
    """Deletes a slice (idempotent). Use as the DAG's teardown (trigger_rule="all_done")."""

    template_fields = ("slice_handle",)

    def __init__(self, *, slice_handle: Any, **kwargs: Any) -> None:
        kwargs.setdefault("trigger_rule", "all_done")
        super().__init__(**kwargs)
        self.slice_handle = slice_handle

    def execute(self, context: Any) -> None:
        if not self.slice_handle:
            self.log.info("no slice handle (provisioning never succeeded): nothing to delete")
            return
        handle = _as_handle_dict(self.slice_handle, "slice_handle")
        self._backend().teardown(handle)
        self.log.info("slice %s torn down", handle["name"])
