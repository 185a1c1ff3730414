"""What the RLAX DAG files build their tasks with: the DAG decorator, the Assets, and the one
place that knows the operators' signatures (provision, job, teardown, the mapped jobs, the
service start) wired to a TrainingPlan's fields (docs/design.md §10).

The scheduler imports this module when it parses the DAGs; environment settings are read when
a task is built or runs (``rlax_tasks.airflow.settings``)."""

from __future__ import annotations

import datetime as dt
import json
import os
from typing import Any

from airflow.sdk import Asset, dag

from rlax_tasks.airflow.compute_connection import compute_backend
from rlax_tasks.airflow.operators import (
    ProvisionSliceOperator,
    ProvisionSlicesOperator,
    RlaxJobOperator,
    TeardownSliceOperator,
    job_name_for,
    start_jobs,
)
from rlax_tasks.airflow.settings import default_run_root, poll_interval, sibling_grace_s
from rlax_tasks.compute import MANAGED_LABEL, RUN_ID_LABEL
from rlax_tasks.plan.run_plan import TrainingPlan
from rlax_tasks.rundir import storage

OWNER = "rlax"
# produced by rlax_curate (event extra: {"path": curated train file}); rlax_train runs on it
CURATED_DATASET = Asset(name="rlax_curated_dataset", uri="rlax://datasets/curated")
# produced by rlax_nightly_eval (event extra: {"evaluated": [{"run_dir", "version"}]})
NIGHTLY_EVAL = Asset(name="rlax_nightly_eval", uri="rlax://eval/nightly")
DEFAULT_ARGS: dict[str, Any] = {
    "owner": OWNER,
    "retries": 2,
    "retry_delay": dt.timedelta(seconds=float(os.environ.get("RLAX_RETRY_DELAY_S") or 60)),
    "retry_exponential_backoff": True,
    "max_retry_delay": dt.timedelta(minutes=15),
}
START_DATE = dt.datetime(2025, 1, 1, tzinfo=dt.UTC)
SERVICE_COMMANDS = ("ps", "trainer", "worker", "heldout")  # the jobs `finish` stops


def rlax_dag(
    dag_id: str,
    *,
    schedule: Any,
    tags: list[str],
    doc_md: str,
    params: dict[str, Any],
    max_active_runs: int = 1,
) -> Any:
    """``airflow.sdk.dag`` with what every RLAX DAG shares: START_DATE without catch-up,
    DEFAULT_ARGS (owner, retries) and the "rlax" tag before ``tags``."""
    return dag(
        dag_id=dag_id, schedule=schedule, start_date=START_DATE, catchup=False,
        max_active_runs=max_active_runs, default_args=DEFAULT_ARGS, tags=["rlax", *tags],
        doc_md=doc_md, params=params,
    )  # fmt: skip


def single_slice(plan: Any) -> tuple[Any, Any, Any]:
    """(run root, provision, teardown) of the one slice a plan task's output describes (its
    "slice", "run_id", "accelerator_type", "runtime_version"): the teardown always runs."""
    root = default_run_root()
    slice_ = provision(
        "provision", root, plan["slice"], plan["run_id"], plan["accelerator_type"],
        runtime_version=plan["runtime_version"],
    )  # fmt: skip
    return root, slice_, teardown("teardown", root, slice_.output).as_teardown(setups=slice_)


def provision(
    task_id: str,
    run_root: str,
    name: str,
    run_id: str,
    accelerator_type: str,
    runtime_version: Any = "",
    **kw: Any,
) -> ProvisionSliceOperator:
    """A ProvisionSliceOperator for slice ``name`` of run ``run_id`` (labelled for the janitor);
    ``name``/``run_id``/``runtime_version`` may be templates or XComArgs ("": none, which only
    the local backend accepts)."""
    return ProvisionSliceOperator(
        task_id=task_id,
        name=name,
        accelerator_type=accelerator_type,
        runtime_version=runtime_version,
        **_managed_slice_args(run_root, run_id),
        **poll_interval(kw),
    )


def provision_slices(
    task_id: str, run_root: Any, slices: Any, run_id: Any, **kw: Any
) -> ProvisionSlicesOperator:
    """A ProvisionSlicesOperator for a run's slices (a TrainingPlan's ``slices``; an XComArg
    from plan), labelled for the janitor: its output holds each role's handle
    (``output["trainer"]``) and ``output["all"]``."""
    return ProvisionSlicesOperator(
        task_id=task_id, slices=slices, **_managed_slice_args(run_root, run_id),
        **poll_interval(kw),
    )  # fmt: skip


def _managed_slice_args(run_root: Any, run_id: Any) -> dict[str, Any]:
    """The backend of ``run_root`` and the labels by which the janitor finds a run's slices."""
    return {**_at_run_time(run_root), "labels": {MANAGED_LABEL: "true", RUN_ID_LABEL: run_id}}


def _at_run_time(run_root: Any) -> dict[str, Any]:
    """An operator's backend, resolved from the compute Connection when its task runs (not when
    the scheduler parses the DAG): ``run_root`` may be an XComArg of the plan."""
    return {"backend": None, "backend_settings": {"run_root": run_root}}


def job(
    task_id: str, run_root: Any, slice_handle: Any, argv: Any, env: Any = None, **kw: Any
) -> RlaxJobOperator:
    """An RlaxJobOperator running ``rlax <argv>`` on ``slice_handle`` (deferrable)."""
    kw.setdefault("sibling_grace_s", sibling_grace_s())
    return RlaxJobOperator(
        task_id=task_id,
        **_at_run_time(run_root),
        slice_handle=slice_handle,
        argv=argv,
        env=env or {},
        **poll_interval(kw),
    )


def planned_job(
    task_id: str, run_root: Any, slice_handle: Any, planned: Any, **kw: Any
) -> RlaxJobOperator:
    """An RlaxJobOperator running a job of the plan (``planned``: a TrainingPlan job field,
    ``plan["trainer"]``) with its command line, environment and hosts on ``slice_handle``."""
    return job(task_id, run_root, slice_handle, argv=None, job=planned, **kw)


def teardown(task_id: str, run_root: Any, slice_handle: Any, **kw: Any) -> TeardownSliceOperator:
    """A TeardownSliceOperator (idempotent) for ``slice_handle``."""
    return TeardownSliceOperator(
        task_id=task_id,
        **_at_run_time(run_root),
        slice_handle=slice_handle,
        **kw,
    )


def mapped_jobs(
    task_id: str, run_root: Any, slice_handle: Any, argvs: Any, env: Any = None, **kw: Any
) -> Any:
    """RlaxJobOperator mapped over ``argvs`` (one job per command line) on one slice."""
    kw.setdefault("sibling_grace_s", sibling_grace_s())
    return RlaxJobOperator.partial(
        task_id=task_id,
        **_at_run_time(run_root),
        slice_handle=slice_handle,
        env=env or {},
        **kw,
    ).expand(argv=argvs)


def mapped_planned_jobs(task_id: str, run_root: Any, jobs: Any, **kw: Any) -> Any:
    """RlaxJobOperator mapped over ``jobs`` (``worker_jobs``: [{"job", "slice_handle"}]), one
    job each (each worker with its own devices, on its own slice and host)."""
    kw.setdefault("sibling_grace_s", sibling_grace_s())
    return RlaxJobOperator.partial(
        task_id=task_id,
        argv=None,
        **_at_run_time(run_root),
        **kw,
    ).expand_kwargs(jobs)


def worker_jobs(plan: TrainingPlan, slices: dict[str, Any]) -> list[dict[str, Any]]:
    """The mapped worker tasks' arguments: each worker's planned job with the handle of its
    slice (``slices``: the ProvisionSlicesOperator output, {role: handle})."""
    return [{"job": w.to_dict(), "slice_handle": slices[w.slice]} for w in plan.workers]


def replica_jobs(plan: TrainingPlan, slices: dict[str, Any]) -> list[dict[str, Any]]:
    """The mapped parameter-server replica tasks' arguments (``ps-1``, ...; none with one
    replica, and the task is skipped), as ``worker_jobs``."""
    return [{"job": r.to_dict(), "slice_handle": slices[r.slice]} for r in plan.ps_replicas]


def start_services(plan: TrainingPlan, slices: dict[str, Any]) -> dict[str, Any]:
    """Starts the run's ps, trainer, workers and controller at once, each on its slice and
    hosts (``slices``: {role: handle}), named as their watching tasks name them, each with its
    own environment (devices); returns {job name: job handle}."""
    jobs = {
        "ps": plan.ps,
        **{job_name_for("ps_replica", i): r for i, r in enumerate(plan.ps_replicas)},
        "trainer": plan.trainer,
        **{job_name_for("worker", i): w for i, w in enumerate(plan.workers)},
        "controller": plan.controller,
    }
    started: dict[str, Any] = {}
    for name, planned in jobs.items():
        if not planned.argv:  # not a job of this run (a colocated run has only the controller's)
            continue
        started.update(
            start_jobs(
                *compute_backend(plan.run_root),
                slices[planned.slice],
                {name: planned.argv},
                planned.env,
                hosts=list(planned.hosts),
            )
        )
    return started


def service_job_handles(slice_handles: Any) -> list[dict[str, Any]]:
    """Handles of the service jobs (ps, trainer, workers) started on a slice (or each of a list
    of slices), read from each job's status directory ``<slice root>/jobs/<job>/spec.json``."""
    handles = slice_handles if isinstance(slice_handles, list) else [slice_handles]
    return [job for handle in handles for job in _service_jobs(handle)]


def _service_jobs(slice_handle: dict[str, Any]) -> list[dict[str, Any]]:
    jobs_dir = storage.join(slice_handle["root"], "jobs")
    out = []
    for name in storage.list_children(jobs_dir):
        try:
            spec = json.loads(storage.read_bytes(storage.join(jobs_dir, name, "spec.json")))
        except (FileNotFoundError, ValueError):
            continue  # an archived attempt (jobs/<name>.<n>) or a half-written spec
        argv = (spec.get("job") or {}).get("argv") or []
        if argv and argv[0] in SERVICE_COMMANDS and "handle" in spec:
            out.append(spec["handle"])
    return out
