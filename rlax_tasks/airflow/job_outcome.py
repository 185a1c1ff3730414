"""How a job's end becomes its task's outcome: the retryable errors, the mapping of a
JobStateTrigger event onto them, the job names tasks give their jobs, and which sibling tasks
failed for good. Light (no operator, no backend): the operators and the DAG helpers share it."""

from __future__ import annotations

import logging
import re
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from rlax_tasks.compute import JobState
from rlax_tasks.compute.types import CONFIG_ERROR_EXIT_CODE

log = logging.getLogger(__name__)


class JobPreemptedError(AirflowException):
    """The job or its slice was taken away; a retry resumes it (retryable)."""


class JobFailedError(AirflowException):
    """The job failed for a reason other than configuration (retryable)."""


class SliceUnavailableError(AirflowException):
    """The slice could not be provisioned or was lost (retryable)."""


def failed_sibling_tasks(context: Any, siblings: list[str]) -> list[str]:
    """The tasks of this DAG run that run the jobs named ``siblings`` and failed for good (their
    retries spent), as Airflow keys them (``task``, ``task_<map index>``); [] where the run's
    task states cannot be read."""
    ti, dag_run = context.get("ti"), context.get("dag_run")
    if ti is None or dag_run is None or not hasattr(ti, "get_task_states"):
        return []
    try:
        runs = ti.get_task_states(dag_id=dag_run.dag_id, run_ids=[dag_run.run_id])
    except Exception as e:  # noqa: BLE001 - a watcher that cannot tell goes on watching
        log.warning("could not read the task states of run %s: %s", dag_run.run_id, e)
        return []
    failed = []
    for key, state in (runs.get(dag_run.run_id) or {}).items():
        mapped = re.fullmatch(r"(.+)_(\d+)", key)
        name = job_name_for(mapped[1], int(mapped[2])) if mapped else job_name_for(key)
        if state == "failed" and name in siblings:
            failed.append(key)
    return sorted(failed)


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
