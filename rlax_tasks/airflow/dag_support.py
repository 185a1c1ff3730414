"""What the RLAX DAG files share: Params and their settings, run-config overrides, the plan
task's XCom shape and the operator factories (``from rlax_tasks.airflow import dag_support as rc``).

The scheduler imports this module when it parses the DAGs: the run config loads inside
``plan_training``, which runs in a task. Environment settings: docs/ (Airflow)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import re
from importlib import resources
from typing import Any

from airflow.sdk import Asset, Param, dag

from rlax_tasks.airflow.compute_connection import compute_backend
from rlax_tasks.airflow.operators import (
    ProvisionSliceOperator,
    ProvisionSlicesOperator,
    RlaxJobOperator,
    TeardownSliceOperator,
    job_name_for,
    start_jobs,
)
from rlax_tasks.compute import MANAGED_LABEL, RUN_ID_LABEL, SliceSpec
from rlax_tasks.compute.cloud_tpu import local_run_root_error
from rlax_tasks.compute.types import slice_name
from rlax_tasks.plan.slices import PlanError, run_slices
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

log = logging.getLogger(__name__)
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
# docs/design.md §4 objective presets (tests/dags checks this against rlax_tasks.algorithms.config)
ALGORITHMS = (
    "grpo",
    "dapo",
    "dr_grpo",
    "rloo",
    "reinforce_seq",
    "reinforce_token",
    "reinforce_pp",
    "cispo",
    "gspo",
    "ppo",
)
# docs/design.md §11 dataset formats (tests/dags checks this against rlax_tasks.data.formats)
DATA_FORMATS = ("rlax", "gsm8k", "math", "dapo", "messages", "code", "columns")
# run ids double as Cloud label values (rlax-run-id) and directory names
RUN_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"


# --------------------------------------------------------------------------- settings
def preset_names() -> list[str]:
    """Run-config presets shipped with rlax_tasks (file stems; no JAX import)."""
    root = resources.files("rlax_tasks.presets")
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


def default_run_root() -> str:
    return os.environ.get("RLAX_RUN_ROOT", "").strip() or "runs"


def run_roots() -> list[str]:
    """Run roots scanned by the nightly evaluation and the janitor."""
    text = os.environ.get("RLAX_RUN_ROOTS", "")
    return [r.strip() for r in text.split(",") if r.strip()] or [default_run_root()]


def backend_name() -> str:
    """The compute backend of a task running now (``compute_connection.compute_backend``)."""
    return compute_backend(default_run_root())[0]


def backend_settings(run_root: str) -> dict[str, Any]:
    """Settings for ``rlax_tasks.compute.get_backend`` of a task running now, with ``run_root``:
    the compute Connection's, else RLAX_BACKEND_SETTINGS."""
    return compute_backend(run_root)[1]


def dag_run_run_id(dag_run_id: str) -> str:
    """An RLAX run id derived from an Airflow DAG run id (e.g. "manual__2025-...")."""
    text = re.sub(r"[^a-z0-9_-]+", "-", dag_run_id.lower()).strip("-_")
    return (text or "run")[:63]


# --------------------------------------------------------------------------- training plan
def _overrides(
    params: dict[str, Any],
    run_root: str,
    run_id: str,
    dataset: str,
    verifier: str,
    workers: Any = None,
) -> dict:
    """The run-config overrides the Params ask for (``workers``: ``worker_slice_layout``)."""
    out: dict[str, Any] = {"run_root": run_root, "run_id": run_id}
    overrides = params.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise PlanError(f"overrides: must be an object of dotted keys, got {overrides!r}")
    out.update(overrides)
    if params.get("model_path"):
        out["model.path"] = params["model_path"]
        out["model.warmup_if_missing"] = False  # a given model is used as is, never built
        out["model.import_if_missing"] = None
    if params.get("algorithm"):
        out["algorithm.preset"] = params["algorithm"]
    if params.get("reload_every") is not None:
        out["staleness.reload_every"] = params["reload_every"]
    if "max_staleness" in params and params.get("max_staleness") != "preset":
        out["staleness.max_staleness"] = params["max_staleness"]
    if workers is not None:
        count = workers.count * workers.hosts
        if params.get("num_workers") not in (None, count):
            raise PlanError(
                f"num_workers: {params['num_workers']} workers, but {workers.count} "
                f"worker_slices of {params['worker_accelerator_type']} ({workers.hosts} host(s) "
                f"each) run {count}, one per host: leave num_workers empty or change "
                "worker_slices"
            )
        out["workers.count"] = count
        # each worker on every device of a host of its own slice, none of the trainer's
        out["placement.separate_worker_hosts"] = True
    elif params.get("num_workers"):
        out["workers.count"] = params["num_workers"]
    if dataset:
        out["datasets"] = [
            {"name": "curated", "weight": 1.0, "source": {"path": dataset, "verifier": verifier}}
        ]
    return out


def done_marker(run_dir: str) -> str:
    """run_dir/DONE: written once the controller reached the run's steps; the service jobs'
    watchers then stop their jobs (on whichever slice instance they run now)."""
    return run_paths(run_dir).done


def plan_slices(
    run_id: str, slices: list[tuple[str, str, str]], provisioning: dict[str, Any] | None = None
) -> list[dict]:
    """The slices of a run as ProvisionSlicesOperator takes them: [{"role", "name",
    "accelerator_type", "runtime_version", **provisioning}] (``slices``:
    ``rlax_tasks.plan.slices.run_slices``; ``provisioning``: ``slice_provisioning``)."""
    return [
        {"role": role, "name": slice_name(run_id, role), "accelerator_type": kind,
         "runtime_version": runtime, **(provisioning or {})}
        for role, kind, runtime in slices
    ]  # fmt: skip


def slice_provisioning(params: dict[str, Any]) -> dict[str, Any]:
    """How the run's slices are bought and joined to the project (the capacity, service_account,
    network and subnetwork Params), checked as a SliceSpec checks them; PlanError names the
    Param."""
    try:
        fields = SliceSpec.capacity_fields(params.get("capacity") or "spot")
    except ValueError as e:
        raise PlanError(f"capacity: {e}") from None
    for name in ("service_account", "network", "subnetwork"):
        fields[name] = (params.get(name) or "").strip()
    try:
        SliceSpec(name="check", **fields)
    except ValueError as e:
        raise PlanError(str(e)) from None
    return fields


def plan_training(
    params: dict[str, Any], dag_run_id: str, dataset: str = "", verifier: str = "math"
) -> dict[str, Any]:
    """The rlax_train plan task: Params → run config → slices → `rlax run`'s launch steps →
    every job's command line, environment, slice and hosts as XComs (JSON-able). Refuses, with
    PlanError naming the Param or field, before anything is written or provisioned. ``dataset``
    (a curated file from the rlax_curate Asset) replaces the preset's datasets."""
    # the run config loads JAX-free but heavy: in the task, never when the scheduler parses
    from rlax_tasks.config import ConfigChangeError, ConfigError, load_config
    from rlax_tasks.plan import launch, slices
    from rlax_tasks.plan.memory_plan import PlanDoesNotFit
    from rlax_tasks.plan.placement import COLOCATED, is_colocated
    from rlax_tasks.plan.preflight import DatasetError
    from rlax_tasks.plan.topology import TRAINER_SLICE, Job
    from rlax_tasks.services.http import run_token

    run_root = params.get("run_root") or default_run_root()
    backend, settings = compute_backend(run_root)
    run_id = params.get("run_id") or dag_run_run_id(dag_run_id)
    if not re.match(RUN_ID_PATTERN, run_id):
        raise PlanError(f"run_id: {run_id!r} must be lowercase letters, digits, '_', '-'")
    trainer_type = params.get("accelerator_type") or "cpu"
    worker_type = params.get("worker_accelerator_type") or None
    layout = slices.worker_slice_layout(worker_type, params.get("worker_slices"), backend)
    try:
        overrides = _overrides(params, run_root, run_id, dataset, verifier, layout)
        cfg = load_config(params["preset"], overrides)
    except ConfigError as e:
        raise PlanError(f"run config: {e}") from None
    runtime_version = slices.check_slice(
        trainer_type, params.get("runtime_version"), cfg.trainer.hosts, backend
    )
    slices.check_worker_slices(cfg, backend, layout)
    evaluation = slices.evaluation_slice(cfg, backend, layout)
    provisioning = slice_provisioning(params)
    if backend == "cloud_tpu":
        slices.check_slice_memory(cfg, trainer_type, worker_type)
    steps = params.get("steps") or cfg.trainer.total_steps
    if not steps:
        raise PlanError("steps: give the number of training steps (the preset has none)")
    if storage.is_gcs(cfg.run_root) and backend == "local":
        raise PlanError("run_root: the local backend needs a local run root, not gs://")
    if backend == "cloud_tpu":  # refused here, before anything is written or provisioned
        endpoint = settings.get("api_endpoint")
        if (unreadable := local_run_root_error(cfg.run_root, endpoint)) is not None:
            raise PlanError(f"run_root: {unreadable}")
    if cfg.trainer.hosts > 1 and backend == "local":
        raise PlanError(
            f"trainer.hosts: the local backend runs one process per job, the trainer spans "
            f"{cfg.trainer.hosts} hosts (simulate it on this machine with `rlax run`, or use a "
            "multi-host backend)"
        )
    try:  # the launch steps of `rlax run`: memory plan, datasets, model, resolved config
        memory = launch.check_run(cfg)
    except (PlanDoesNotFit, DatasetError) as e:
        raise PlanError(str(e)) from None
    except ValueError as e:  # the model's shapes cannot be read
        raise PlanError(f"memory plan: {e}") from None
    if not storage.is_gcs(cfg.run_root):
        os.makedirs(cfg.run_dir, exist_ok=True)
    try:  # a resume may not change training unless the trigger allows it
        config_path = launch.prepare_run_dir(cfg, bool(params.get("allow_config_change")))
    except ConfigChangeError as e:
        raise PlanError(f"{e} (set the allow_config_change Param to accept it)") from None
    # a run resumed after it completed (more steps) is not complete any more
    storage.delete_prefix(done_marker(cfg.run_dir))
    # addresses are published under run_dir/services/ (unknown before the slices exist)
    topology = launch.plan_jobs(
        cfg, int(steps), config_path, memory, run_token(), worker_slices=layout
    )
    jobs = {job.name: job for job in topology.jobs}
    if is_colocated(cfg):
        # one job, watched by the controller task (its exit 0 ends the run like the
        # controller's); the ps, trainer and worker tasks have no job and are skipped
        jobs = {
            "controller": dataclasses.replace(jobs[COLOCATED], name="controller"),
            "ps": Job("ps", [], {}),
            "trainer": Job("trainer", [], {}),
        }
    planned = plan_slices(
        cfg.run_id,
        run_slices(trainer_type, runtime_version, worker_type, layout, backend),
        provisioning,
    )
    for s in planned:  # ProvisionSlicesOperator's output["evaluation"]: that slice's handle
        if s["role"] == evaluation and evaluation != TRAINER_SLICE:
            s["evaluation"] = True
    xcoms = _plan_xcoms(
        cfg, int(steps), config_path, topology, jobs, runtime_version, planned, is_colocated(cfg)
    )
    if evaluation != TRAINER_SLICE:  # the evaluations take the first worker's devices
        xcoms["env"] = xcoms["envs"]["worker-0"]
    xcoms.update(_heldout_during_training(cfg, config_path, int(steps)))
    return xcoms


def _heldout_during_training(cfg: Any, config_path: str, steps: int) -> dict[str, Any]:
    """The heldout task's job: `rlax heldout` every eval.every_steps versions beside training,
    on host 0 of the trainer slice on devices of its own (placement.evaluator); no command line
    (the task is skipped) without them or when no version before the last is due: a cpu run
    without them, evaluated meanwhile under `rlax run`, is not here by default, as `rlax airflow
    train` (dag.test) runs one watcher at a time and a second holds the controller's back (its
    recovery from a killed job waits for the sibling grace). The evaluations before and after
    training are evaluate_base's and evaluate's."""
    from rlax_tasks.run.heldout import (
        every_during_training,
        heldout_argv,
        heldout_env,
        next_target,
    )
    from rlax_tasks.run.progress import trained_step

    every, why_not = every_during_training(cfg)
    if why_not:
        log.warning("%s", why_not)
    if cfg.placement.evaluator is None:
        every = 0
    after = trained_step(cfg.run_dir)  # a resumed run: the versions after its trained step
    if not every or next_target(after, every) >= steps:
        return {"argv_heldout": [], "env_heldout": {}}
    argv = heldout_argv(config_path, base=False, every=every, last=None, after=after)
    log.info("held-out pass@k every %d steps during training: rlax %s", every, " ".join(argv))
    return {"argv_heldout": argv, "env_heldout": heldout_env(cfg)}


def _plan_xcoms(
    cfg: Any,
    steps: int,
    config_path: str,
    topology: Any,
    jobs: dict[str, Any],
    runtime_version: str,
    slices: list[dict[str, Any]],
    colocated: bool,
) -> dict[str, Any]:
    """The plan task's return value: what the DAG's tasks read as XComs."""
    workers = [jobs[w] for w in topology.workers]
    argv = {
        "ps": jobs["ps"].argv,
        "trainer": jobs["trainer"].argv,
        "controller": jobs["controller"].argv,
        "workers": [w.argv for w in workers],
    }
    envs = {name: job.env for name, job in jobs.items()}
    return {
        "run_id": cfg.run_id,
        "run_root": cfg.run_root,
        "run_dir": cfg.run_dir,
        "config_path": config_path,
        "steps": steps,
        "num_workers": cfg.workers.count,
        "ps_url": topology.ps_url,  # the PS's service file
        "done_marker": done_marker(cfg.run_dir),
        "runtime_version": runtime_version,
        "slices": slices,
        # {job: {"slice": role, "hosts": [...]}}: where each job runs
        "placement": {n: {"slice": j.slice, "hosts": list(j.hosts)} for n, j in jobs.items()},
        "argv": argv,
        # one top-level key per job: the DAG reads them as XComs (plan has multiple outputs, and
        # XComArg["a"]["b"] would look up key "b", not argv["b"])
        **{f"argv_{name}": value for name, value in argv.items()},
        "envs": envs,
        **{f"env_{name}": envs[name] for name in ("ps", "trainer", "controller")},
        "hosts_trainer": list(jobs["trainer"].hosts),
        "colocated": colocated,
        # the mapped worker tasks take their command line, environment, slice and hosts together
        "worker_jobs": [
            {"argv": w.argv, "env": w.env, "slice": w.slice, "hosts": list(w.hosts)}
            for w in workers
        ],
        # jobs after the services (the final `rlax eval`): the trainer's devices, free by then
        "env": envs["controller" if colocated else "trainer"],
    }


# --------------------------------------------------------------------------- DAGs
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


def accelerator_type_param() -> Param:
    """The ``accelerator_type`` Param of a DAG whose job runs on one 1-host slice
    (``single_host_slice`` resolves it)."""
    return Param(
        "cpu", type="string", minLength=1,
        description="the job's slice: cpu on the local backend, a 1-host Cloud TPU type "
        "(e.g. v5litepod-1) on cloud_tpu (booting its family's default runtime)",
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


# --------------------------------------------------------------------------- operators
# One place that knows the rlax_tasks.airflow operator signatures (see its module docstring).
def provision(
    task_id: str,
    run_root: str,
    name: str,
    run_id: str,
    accelerator_type: str,
    runtime_version: Any = "",
    **kw: Any,
):
    """A ProvisionSliceOperator for slice ``name`` of run ``run_id`` (labelled for the janitor);
    ``name``/``run_id``/``runtime_version`` may be templates or XComArgs ("": none, which only
    the local backend accepts)."""
    return ProvisionSliceOperator(
        task_id=task_id,
        name=name,
        accelerator_type=accelerator_type,
        runtime_version=runtime_version,
        **_managed_slice_args(run_root, run_id),
        **_poll_interval(kw),
    )


def provision_slices(task_id: str, run_root: str, slices: Any, run_id: Any, **kw: Any):
    """A ProvisionSlicesOperator for a run's slices (``plan_slices``; an XComArg from plan),
    labelled for the janitor: its output holds each role's handle (``output["trainer"]``) and
    ``output["all"]``."""
    return ProvisionSlicesOperator(
        task_id=task_id, slices=slices, **_managed_slice_args(run_root, run_id),
        **_poll_interval(kw),
    )  # fmt: skip


def _managed_slice_args(run_root: str, run_id: Any) -> dict[str, Any]:
    """The backend of ``run_root`` and the labels by which the janitor finds a run's slices."""
    return {**_at_run_time(run_root), "labels": {MANAGED_LABEL: "true", RUN_ID_LABEL: run_id}}


def _at_run_time(run_root: Any) -> dict[str, Any]:
    """An operator's backend, resolved from the compute Connection when its task runs (not when
    the scheduler parses the DAG): ``run_root`` may be an XComArg of the plan."""
    return {"backend": None, "backend_settings": {"run_root": run_root}}


def sibling_grace_s() -> float:
    return float(os.environ.get("RLAX_SIBLING_GRACE_S") or 600)


def _poll_interval(kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` with RLAX_POLL_INTERVAL_S as the operator's poll interval, where it is set and the
    task names none (unset: the operators' own defaults)."""
    text = os.environ.get("RLAX_POLL_INTERVAL_S", "").strip()
    return {"poll_interval_s": float(text), **kw} if text else kw


def job(task_id: str, run_root: str, slice_handle: Any, argv: Any, env: Any = None, **kw):
    """An RlaxJobOperator running ``rlax <argv>`` on ``slice_handle`` (deferrable)."""
    kw.setdefault("sibling_grace_s", sibling_grace_s())
    return RlaxJobOperator(
        task_id=task_id,
        **_at_run_time(run_root),
        slice_handle=slice_handle,
        argv=argv,
        env=env or {},
        **_poll_interval(kw),
    )


def teardown(task_id: str, run_root: str, slice_handle: Any, **kw):
    """A TeardownSliceOperator (idempotent) for ``slice_handle``."""
    return TeardownSliceOperator(
        task_id=task_id,
        **_at_run_time(run_root),
        slice_handle=slice_handle,
        **kw,
    )


def mapped_jobs(
    task_id: str, run_root: str, slice_handle: Any, argvs: Any, env: Any = None, **kw: Any
):
    """RlaxJobOperator mapped over ``argvs`` (one job per command line) on one slice."""
    kw.setdefault("sibling_grace_s", sibling_grace_s())
    return RlaxJobOperator.partial(
        task_id=task_id,
        **_at_run_time(run_root),
        slice_handle=slice_handle,
        env=env or {},
        **kw,
    ).expand(argv=argvs)


def mapped_jobs_with_env(task_id: str, run_root: str, jobs: Any, **kw: Any):
    """RlaxJobOperator mapped over ``jobs``: [{"argv", "env", "slice_handle", "hosts"}], one
    job each (each worker with its own devices, on its own slice and host)."""
    kw.setdefault("sibling_grace_s", sibling_grace_s())
    return RlaxJobOperator.partial(
        task_id=task_id,
        **_at_run_time(run_root),
        **kw,
    ).expand_kwargs(jobs)


def worker_jobs(plan: dict[str, Any], slices: dict[str, Any]) -> list[dict[str, Any]]:
    """The mapped worker tasks' arguments: each worker's argv, env and hosts with the handle of
    its slice (``slices``: the ProvisionSlicesOperator output, {role: handle})."""
    return [
        {
            "argv": w["argv"],
            "env": w["env"],
            "hosts": w["hosts"],
            "slice_handle": slices[w["slice"]],
        }
        for w in plan["worker_jobs"]
    ]


def start_services(plan: dict[str, Any], slices: dict[str, Any]) -> dict[str, Any]:
    """Starts the run's ps, trainer, workers and controller at once, each on its slice and
    hosts (``slices``: {role: handle}), named as their watching tasks name them, each with its
    own environment (devices); returns {job name: job handle}."""
    argv, envs, where = plan["argv"], plan["envs"], plan["placement"]
    jobs = {
        "ps": ("ps", argv["ps"]),
        "trainer": ("trainer", argv["trainer"]),
        **{job_name_for("worker", i): (f"worker-{i}", a) for i, a in enumerate(argv["workers"])},
        "controller": ("controller", argv["controller"]),
    }
    started: dict[str, Any] = {}
    for name, (planned, job_argv) in jobs.items():
        if not job_argv:  # not a job of this run (a colocated run has only the controller's)
            continue
        started.update(
            start_jobs(
                *compute_backend(plan["run_root"]),
                slices[where[planned]["slice"]],
                {name: job_argv},
                envs[planned],
                hosts=where[planned]["hosts"],
            )
        )
    return started


SERVICE_COMMANDS = ("ps", "trainer", "worker", "heldout")  # the jobs `finish` stops


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
