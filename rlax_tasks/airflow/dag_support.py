"""What the RLAX DAG files share: defaults, Param schemas, backend settings, slice checks, run
planning and the operator factories.

The DAG files only wire tasks: ``from rlax_tasks.airflow import dag_support as rc``. Importing
this module is light (Airflow's scheduler parses the DAGs): heavy imports (the run config, which
imports JAX) happen inside the functions, which run in tasks, never at DAG parse time.

Environment (all optional):
- ``RLAX_RUN_ROOT``: default run root of the DAGs' Params (local directory or gs:// URI; "runs").
- ``RLAX_RUN_ROOTS``: comma-separated run roots the nightly evaluation and the janitor scan
  (default: RLAX_RUN_ROOT); the dashboard lists the same.
- ``RLAX_BACKEND``: compute backend, "local" (default) or "cloud_tpu".
- ``RLAX_BACKEND_SETTINGS``: JSON object of backend settings (e.g. {"project": ..., "zone": ...}).
- ``RLAX_RETRY_DELAY_S``: first retry delay of every task (default 60; doubles per retry).
- ``RLAX_SIBLING_GRACE_S``: how long a job of a run may stay down before the other jobs'
  watchers give way to its task (default 600; see rlax_tasks.airflow.triggers).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import os
import re
import time
from importlib import resources
from typing import Any

from airflow.sdk import Asset, Param, dag

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
# DESIGN §4 objective presets (tests/dags checks this against rlax_tasks.algorithms.config)
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
# DESIGN §11 dataset formats (tests/dags checks this against rlax_tasks.data.formats)
DATA_FORMATS = ("rlax", "gsm8k", "math", "dapo", "messages", "code", "columns")
# run ids double as Cloud label values (rlax-run-id) and directory names
RUN_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
# TPU VM runtime versions (images), e.g. "v2-alpha-tpuv5-lite", "tpu-ubuntu2204-base"
RUNTIME_VERSION_PATTERN = r"^[a-z0-9][a-z0-9.-]*$"
ACTIVE_STATES = ("provisioning", "running")


class PlanError(ValueError):
    """A DAG run's Params do not make a valid run; the message names the Param."""


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
    return os.environ.get("RLAX_BACKEND", "").strip() or "local"


def backend_settings(run_root: str) -> dict[str, Any]:
    """Settings for ``rlax_tasks.compute.get_backend``: RLAX_BACKEND_SETTINGS plus run_root."""
    text = os.environ.get("RLAX_BACKEND_SETTINGS", "").strip()
    try:
        settings = json.loads(text) if text else {}
    except ValueError as e:
        raise PlanError(f"RLAX_BACKEND_SETTINGS is not a JSON object: {e}") from None
    if not isinstance(settings, dict):
        raise PlanError("RLAX_BACKEND_SETTINGS must be a JSON object")
    return {**settings, "run_root": run_root}


def slice_name(run_id: str, role: str) -> str:
    """A valid slice/job name (lowercase letters, digits, hyphens; ≤ 63) for ``role`` of a run."""
    base = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-") or "run"
    name = f"rlax-{base}"[: 62 - len(role)].rstrip("-") + f"-{role}"
    if not name[0].isalpha():
        name = "r" + name[1:]
    return name


def dag_run_run_id(dag_run_id: str) -> str:
    """An RLAX run id derived from an Airflow DAG run id (e.g. "manual__2025-...")."""
    text = re.sub(r"[^a-z0-9_-]+", "-", dag_run_id.lower()).strip("-_")
    return (text or "run")[:63]


# --------------------------------------------------------------------------- slice checks
def check_slice(
    accelerator_type: str, runtime_version: str | None, trainer_hosts: int, backend: str
) -> str:
    """Checks the training slice before anything is provisioned; returns the runtime version to
    provision it with ("" where none is needed).

    On the cloud_tpu backend ``accelerator_type`` must be a Cloud TPU type
    (``rlax_tasks.compute.tpu_types``) with as many hosts as the run config's
    ``trainer.hosts``, and a ``runtime_version`` of None is the default of its family. The local
    backend runs every job on this machine whatever type is named (as it always has): no type
    check, no default runtime. A given ``runtime_version`` must look like one, on any backend.
    PlanError names the Param or config field at fault.
    """
    from rlax_tasks.compute import tpu_types

    if backend == "cloud_tpu":
        try:
            default = tpu_types.tpu_type(accelerator_type).runtime_version
        except tpu_types.UnknownAcceleratorError as e:
            raise PlanError(
                f"accelerator_type: {e}; the cloud_tpu backend provisions Cloud TPU types only"
            ) from None
    if runtime_version is not None and not re.match(RUNTIME_VERSION_PATTERN, runtime_version):
        raise PlanError(
            f"runtime_version: {runtime_version!r} is not a TPU runtime version (lowercase "
            "letters, digits, '.', '-', e.g. 'v2-alpha-tpuv5-lite'); leave it empty (null) for "
            "the accelerator's default"
        )
    if backend != "cloud_tpu":
        return runtime_version or ""
    hosts = tpu_types.slice_hosts(accelerator_type)
    if hosts != trainer_hosts:
        other = _type_with_hosts(accelerator_type, trainer_hosts)
        pick = f" or pick a {trainer_hosts}-host type ({other})" if other else ""
        fix = json.dumps({"trainer.hosts": hosts})
        raise PlanError(
            f"accelerator_type: {accelerator_type} has {_hosts(hosts)} but trainer.hosts is "
            f"{trainer_hosts}: set overrides {fix}{pick}"
        )
    return runtime_version or default


def _hosts(n: int) -> str:
    return f"{n} host" if n == 1 else f"{n} hosts"


def single_host_slice(accelerator_type: str | None) -> tuple[str, str]:
    """(accelerator type, runtime version) of the one-host slice a curation or evaluation job
    runs on: on cloud_tpu a 1-host Cloud TPU type booting its family's default runtime; on the
    local backend the type as given ("cpu" by default) and no runtime. PlanError names
    ``accelerator_type``."""
    from rlax_tasks.compute import tpu_types

    kind = accelerator_type or "cpu"
    if backend_name() != "cloud_tpu":
        return kind, ""
    try:
        tpu = tpu_types.tpu_type(kind)
    except tpu_types.UnknownAcceleratorError as e:
        raise PlanError(
            f"accelerator_type: {e}; the cloud_tpu backend provisions Cloud TPU types only "
            "(e.g. v5litepod-1)"
        ) from None
    if tpu.hosts != 1:
        raise PlanError(
            f"accelerator_type: {kind} has {_hosts(tpu.hosts)} but this job runs on one: pick a "
            "1-host type (e.g. v5litepod-1, v4-8)"
        )
    return kind, tpu.runtime_version


def _type_with_hosts(accelerator_type: str, hosts: int) -> str | None:
    """The largest type of ``accelerator_type``'s family with ``hosts`` hosts (None: none)."""
    from rlax_tasks.compute import tpu_types

    prefix = accelerator_type.rsplit("-", 1)[0]
    best = None
    for n in range(1, 16 * hosts + 1):  # at most 8 chips a host, 2 TensorCores a chip
        try:
            if tpu_types.slice_hosts(f"{prefix}-{n}") == hosts:
                best = f"{prefix}-{n}"
        except tpu_types.UnknownAcceleratorError:
            continue
    return best


# --------------------------------------------------------------------------- status
def write_status(run_dir: str, state: str, dag_run_id: str | None = None, **extra: Any) -> None:
    """Writes run_dir/status.json (read by the dashboard and the janitor): {"state", "updated",
    "dag_run_id", ...``extra``}; the DAGs add "dag_id" (the dashboard links the DAG run)."""
    from rlax_tasks.rundir import storage
    from rlax_tasks.rundir.paths import run_paths

    record = {"state": state, "updated": time.time(), "dag_run_id": dag_run_id, **extra}
    storage.write_bytes(run_paths(run_dir).status, json.dumps(record).encode())


def read_status(run_dir: str) -> dict[str, Any] | None:
    from rlax_tasks.rundir import storage
    from rlax_tasks.rundir.paths import run_paths

    try:
        data = json.loads(storage.read_bytes(run_paths(run_dir).status))
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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
                f"worker_slices of {params['worker_accelerator_type']} ({_hosts(workers.hosts)} "
                f"each) run {count}, one per host: leave num_workers empty or change "
                "worker_slices"
            )
        out["workers.count"] = count
    elif params.get("num_workers"):
        out["workers.count"] = params["num_workers"]
    if dataset:
        out["datasets"] = [
            {"name": "curated", "weight": 1.0, "source": {"path": dataset, "verifier": verifier}}
        ]
    return out


def worker_slice_layout(params: dict[str, Any]) -> Any:
    """The workers' own slices (``rlax_tasks.run.topology.WorkerSlices``) the Params ask for
    (``worker_accelerator_type``, ``worker_slices``), or None: the workers run on the trainer
    slice."""
    from rlax_tasks.compute import tpu_types
    from rlax_tasks.run.topology import WorkerSlices

    kind = params.get("worker_accelerator_type")
    if not kind:
        return None
    count = params.get("worker_slices") or 1
    if not isinstance(count, int) or count < 1:
        raise PlanError(f"worker_slices: give a number of slices >= 1, got {count!r}")
    if backend_name() != "cloud_tpu":
        return WorkerSlices(count, 1)  # a local slice is this machine, one host, whatever type
    try:
        hosts = tpu_types.tpu_type(kind).hosts
    except tpu_types.UnknownAcceleratorError as e:
        raise PlanError(f"worker_accelerator_type: {e}") from None
    return WorkerSlices(count, hosts)


def done_marker(run_dir: str) -> str:
    """run_dir/DONE: written once the controller reached the run's steps; the service jobs'
    watchers then stop their jobs (on whichever slice instance they run now)."""
    from rlax_tasks.rundir.paths import run_paths

    return run_paths(run_dir).done


def check_slice_memory(cfg: Any, params: dict[str, Any]) -> None:
    """Refuses, in one line naming the Param to change, a run whose model does not fit the
    chips of its slices (the trainer over every chip of ``accelerator_type``, each worker on a
    host of ``worker_accelerator_type``), whatever ``placement.accelerator`` says."""
    from rlax_tasks.run.plan import slice_fit_error, slice_memory_plan

    kind = params.get("accelerator_type") or "cpu"
    try:
        plan = slice_memory_plan(cfg, kind, params.get("worker_accelerator_type") or None)
    except ValueError as e:  # a conflicting placement.accelerator, shapes that cannot be read
        raise PlanError(str(e).replace("\n", " ")) from None
    log.info("the run on its slices:\n%s", plan.format(problems=False))
    error = slice_fit_error(plan, kind)
    if error:
        raise PlanError(error)


def plan_slices(
    params: dict[str, Any], run_id: str, trainer_runtime: str, layout: Any = None
) -> list[dict]:
    """The slices of a run, the trainer's first: [{"role", "name", "accelerator_type",
    "runtime_version"}], with ``layout`` (``worker_slice_layout``) worker slices. A worker slice
    boots the Params' ``runtime_version`` when its type is of
    the trainer type's family, else its own family's default (cloud_tpu; "" on local)."""
    from rlax_tasks.compute import tpu_types
    from rlax_tasks.run.topology import TRAINER_SLICE, worker_slice

    trainer_type = params.get("accelerator_type") or "cpu"
    slices = [
        {
            "role": TRAINER_SLICE,
            "name": slice_name(run_id, TRAINER_SLICE),
            "accelerator_type": trainer_type,
            "runtime_version": trainer_runtime,
        }
    ]
    if layout is None:
        return slices
    kind = params["worker_accelerator_type"]
    runtime = ""
    if backend_name() == "cloud_tpu":
        own = tpu_types.tpu_type(kind)
        same = own.family == tpu_types.tpu_type(trainer_type).family
        runtime = trainer_runtime if same else own.runtime_version
    for i in range(layout.count):
        role = worker_slice(i)
        slices.append(
            {
                "role": role,
                "name": slice_name(run_id, role),
                "accelerator_type": kind,
                "runtime_version": runtime,
            }
        )
    return slices


def plan_training(
    params: dict[str, Any], dag_run_id: str, dataset: str = "", verifier: str = "math"
) -> dict[str, Any]:
    """Validates the Params into a run config, checks its memory plan, writes
    run_dir/config.yaml, builds the base model if the config asks for it, and returns every
    job's ``rlax`` command line and environment (JSON-able).

    A plan that does not fit the accelerator named in ``placement`` is refused here, before
    anything starts (PlanError with the plan's message), and so is a slice the backend cannot
    provision for it (``check_slice``: Params ``accelerator_type``, ``runtime_version``; the
    returned ``runtime_version`` is the one to provision with). Each job's environment gives it
    its own devices (rlax_tasks.run.placement). The services bind their host's address on a free
    port and publish it under run_dir/services/ (rlax_tasks.services.endpoints): addresses
    are not known before the slices exist, and change when one is re-provisioned. ``slices``
    lists the slices
    to provision (``plan_slices``) and each job names its slice (role) and hosts. ``dataset``
    (a curated file, e.g.
    from the rlax_curate Asset) replaces the preset's datasets (``verifier``: "math" or "code",
    as rlax_curate published it).
    """
    from rlax_tasks.config import ConfigChangeError, ConfigError, load_config, save_resolved
    from rlax_tasks.run.compilation_cache import cache_env
    from rlax_tasks.run.local_run import ensure_model
    from rlax_tasks.run.placement import COLOCATED, describe, is_colocated
    from rlax_tasks.run.plan import memory_plan
    from rlax_tasks.run.preflight import DatasetError, check_datasets
    from rlax_tasks.run.topology import Job, plan_topology, write_workers_file
    from rlax_tasks.rundir import storage
    from rlax_tasks.services.http import run_token

    run_root = params.get("run_root") or default_run_root()
    run_id = params.get("run_id") or dag_run_run_id(dag_run_id)
    if not re.match(RUN_ID_PATTERN, run_id):
        raise PlanError(f"run_id: {run_id!r} must be lowercase letters, digits, '_', '-'")
    layout = worker_slice_layout(params)
    try:
        overrides = _overrides(params, run_root, run_id, dataset, verifier, layout)
        cfg = load_config(params["preset"], overrides)
    except ConfigError as e:
        raise PlanError(f"run config: {e}") from None
    runtime_version = check_slice(
        params.get("accelerator_type") or "cpu",
        params.get("runtime_version"),
        cfg.trainer.hosts,
        backend_name(),
    )
    if backend_name() == "cloud_tpu":
        check_slice_memory(cfg, params)
    steps = params.get("steps") or cfg.trainer.total_steps
    if not steps:
        raise PlanError("steps: give the number of training steps (the preset has none)")
    if storage.is_gcs(cfg.run_root) and backend_name() == "local":
        raise PlanError("run_root: the local backend needs a local run root, not gs://")
    if cfg.trainer.hosts > 1 and backend_name() == "local":
        raise PlanError(
            f"trainer.hosts: the local backend runs one process per job, the trainer spans "
            f"{cfg.trainer.hosts} hosts (simulate it on this machine with `rlax run`, or use a "
            "multi-host backend)"
        )
    try:
        memory = memory_plan(cfg, offline=False)
    except ValueError as e:  # the model's shapes cannot be read
        raise PlanError(f"memory plan: {e}") from None
    log.info("run %s\n%s\n%s", cfg.run_id, describe(cfg), memory.format())
    if not memory.fits:
        raise PlanError(memory.message())
    if not storage.is_gcs(cfg.run_root):
        os.makedirs(cfg.run_dir, exist_ok=True)
    try:  # a dataset that cannot be read fails the plan, naming the file and row
        check_datasets(cfg)
    except DatasetError as e:
        raise PlanError(str(e)) from None
    ensure_model(cfg)
    try:  # a resume may not change training unless the trigger allows it
        config_path = save_resolved(
            cfg, allow_config_change=bool(params.get("allow_config_change"))
        )
    except ConfigChangeError as e:
        raise PlanError(f"{e} (set the allow_config_change Param to accept it)") from None
    # a run resumed after it completed (more steps) is not complete any more
    storage.delete_prefix(done_marker(cfg.run_dir))
    # the bearer token of the run's services (DESIGN §6, §13) and its compilation cache, plus
    # each job's own devices (DESIGN §12): one planner for rlax run and this DAG
    topology = plan_topology(
        cfg, int(steps), config_path, None, memory.ps.argv(), run_token(),
        base_env=cache_env(cfg), worker_slices=layout,
    )  # fmt: skip
    jobs = {job.name: job for job in topology.jobs}
    if is_colocated(cfg):
        # one job, watched by the controller task (its exit 0 ends the run like the
        # controller's); the ps, trainer and worker tasks have no job and are skipped
        jobs = {
            "controller": dataclasses.replace(jobs[COLOCATED], name="controller"),
            "ps": Job("ps", [], {}),
            "trainer": Job("trainer", [], {}),
        }
    else:
        write_workers_file(cfg, topology)
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
        "steps": int(steps),
        "num_workers": cfg.workers.count,
        "ps_url": topology.ps_url,  # the PS's service file
        "done_marker": done_marker(cfg.run_dir),
        "runtime_version": runtime_version,
        "slices": plan_slices(params, cfg.run_id, runtime_version, layout),
        # {job: {"slice": role, "hosts": [...]}}: where each job runs
        "placement": {n: {"slice": j.slice, "hosts": list(j.hosts)} for n, j in jobs.items()},
        "argv": argv,
        # one top-level key per job: the DAG reads them as XComs (plan has multiple outputs, and
        # XComArg["a"]["b"] would look up key "b", not argv["b"])
        **{f"argv_{name}": value for name, value in argv.items()},
        "envs": envs,
        **{f"env_{name}": envs[name] for name in ("ps", "trainer", "controller")},
        "hosts_trainer": list(jobs["trainer"].hosts),
        "colocated": is_colocated(cfg),
        # the mapped worker tasks take their command line, environment, slice and hosts together
        "worker_jobs": [
            {"argv": w.argv, "env": w.env, "slice": w.slice, "hosts": list(w.hosts)}
            for w in workers
        ],
        # jobs after the services (the final `rlax eval`): the trainer's devices, free by then
        "env": envs["controller" if is_colocated(cfg) else "trainer"],
    }


# --------------------------------------------------------------------------- evaluation
def eval_dataset_file(cfg: Any) -> str:
    """A held-out dataset file for ``rlax eval``: the config's eval file, or its synthetic task
    written once to run_dir/eval/heldout.jsonl in the curated schema."""
    from rlax_tasks.config import FileSource, SyntheticSource
    from rlax_tasks.rundir import storage
    from rlax_tasks.rundir.paths import run_paths

    spec = cfg.eval.dataset
    if spec is None:
        raise PlanError("eval.dataset: the run config names no held-out dataset")
    if isinstance(spec.source, FileSource):
        return spec.source.path
    assert isinstance(spec.source, SyntheticSource)
    path = run_paths(cfg.run_dir).heldout
    if storage.exists(path):
        return path
    src = spec.source
    if src.prompt_format == "compact":
        from rlax_tasks.warmup import TinyArith

        fmt = TinyArith(dict(src.knobs))
        problems = fmt.problems(cfg.eval.num_prompts, seed=src.seed)
        rows = [(p.prompt, fmt.answer_text(p)) for p in problems]
    else:
        from rlax_tasks.rewards.tasks import make_task

        problems = make_task(src.task, **dict(src.knobs)).generate(cfg.eval.num_prompts, src.seed)
        rows = [(p.prompt, p.reference) for p in problems]
    today = dt.date.today().isoformat()
    lines = [
        json.dumps({"prompt": q, "answer": a, "source": spec.name, "date": today}) for q, a in rows
    ]  # the row schema (format rlax)
    storage.write_bytes(path, ("\n".join(lines) + "\n").encode())
    return path


def eval_argv(cfg: Any, version: int, dataset: str) -> list[str]:
    """`rlax eval` of weight ``version`` mirrored under the run, into run_dir/eval/v<version>/
    (the directory the dashboard reads pass@k from): the dataset read in its format, prompts
    rendered by the run's own `prompt` section (its config.yaml), as in training."""
    return _eval_argv(cfg, dataset, ["--weights-from", f"{cfg.run_dir}@{version}"], version)


def base_eval_argv(cfg: Any, dataset: str) -> list[str]:
    """`rlax eval` of the run's starting weights (the model directory alone) into
    run_dir/eval/v0/: the same evaluation as ``eval_argv``'s of the final weights."""
    from rlax_tasks.evaluation.base_eval import BASE_VERSION

    return _eval_argv(cfg, dataset, [], BASE_VERSION)


def _eval_argv(cfg: Any, dataset: str, weights: list[str], version: int) -> list[str]:
    from rlax_tasks.config import FileSource
    from rlax_tasks.rundir.paths import run_paths

    paths = run_paths(cfg.run_dir)
    e = cfg.eval
    source = e.dataset.source if e.dataset is not None else None
    data_format = []
    if isinstance(source, FileSource):
        data_format = ["--format", source.format]
        if source.columns:
            data_format += ["--columns", ",".join(f"{k}={v}" for k, v in source.columns.items())]
    return [
        "eval", "--model-dir", cfg.model.path, *weights,
        "--dataset", dataset, "--n", str(e.num_samples), "--k", ",".join(map(str, e.ks)),
        "--limit", str(e.num_prompts), "--temperature", str(e.temperature),
        "--max-new-tokens", str(cfg.rollout.max_new_tokens),
        "--max-len", str(cfg.workers.max_len), "--max-slots", str(cfg.workers.slots),
        "--dtype", cfg.model.dtype, "--out", paths.eval_dir(version),
        "--prompt-config", paths.config, *data_format,
    ]  # fmt: skip


def prepare_base_eval(run_dir: str) -> dict[str, Any]:
    """The base evaluation of the run at ``run_dir`` (``rlax_tasks.evaluation.base_eval``): when
    the run root caches it, copies it into run_dir/eval/v0 and gives an empty ``argv`` (the
    evaluate_base job is skipped); else ``argv`` is the `rlax eval` to run. The plan as a dict
    (for ``record_base_eval``)."""
    from rlax_tasks.evaluation import base_eval

    cfg = load_run_config(run_dir)
    plan = base_eval.plan_base_eval(cfg, base_eval_argv(cfg, eval_dataset_file(cfg)))
    if base_eval.restore(plan):
        return {**plan.to_dict(), "argv": []}
    log.info("base evaluation %s not cached: evaluating (rlax %s)", plan.fingerprint,
             " ".join(plan.argv))  # fmt: skip
    return plan.to_dict()


def record_base_eval(plan: dict[str, Any]) -> None:
    """After the evaluate_base job: caches the run's fresh eval/v0 under its fingerprint (a
    plan restored from the cache has nothing to record)."""
    from rlax_tasks.evaluation import base_eval

    if plan["argv"]:
        base_eval.store(base_eval.BaseEvalPlan.from_dict(plan))


def record_nightly_history(runs: list[dict[str, Any]], dag_run_id: str) -> list[dict[str, Any]]:
    """Appends each evaluated run's new evaluation ({"run_dir", "version"}) to its history
    (run_dir/eval/history.jsonl); a run whose evaluation failed is logged and left out."""
    from rlax_tasks.evaluation.history import append_evaluation

    rows = []
    for item in runs:
        row = append_evaluation(item["run_dir"], int(item["version"]), dag_run_id)
        if row is not None:
            rows.append({"run_dir": item["run_dir"], **row})
    return rows


def newest_version(run_dir: str) -> int | None:
    """The newest committed weight version mirrored under run_dir/weights (None: none yet)."""
    from rlax_tasks.paramserver import mirror

    committed, _ = mirror.mirrored_versions(run_dir)
    return committed[-1] if committed else None


def write_run_report(run_dir: str) -> str:
    """eval/report.md, report.json and the plots of a trained run, as `rlax run` writes them:
    the held-out scores of the starting weights (eval/v0) against the newest evaluated version;
    the training time spans the metrics rows (first to last step). Returns report.md's path."""
    from rlax_tasks.evaluation.history import evaluated_versions, read_overall
    from rlax_tasks.run.report import write_report
    from rlax_tasks.rundir import storage
    from rlax_tasks.rundir.paths import run_paths

    paths = run_paths(run_dir)
    versions = evaluated_versions(run_dir)
    if not versions or versions[0] != 0 or versions[-1] == 0:
        raise FileNotFoundError(
            f"{paths.eval}: the report needs the evaluations of the starting weights (v0) and "
            f"of a trained version; found {[f'v{v}' for v in versions] or 'none'}"
        )
    before, after = read_overall(run_dir, 0), read_overall(run_dir, versions[-1])
    metrics = [m for m in storage.read_jsonl(paths.metrics) if "time" in m and "step" in m]
    report = {
        "before": {"version": 0, **before},
        "after": {"version": versions[-1], **after},
        "steps": metrics[-1]["step"] if metrics else versions[-1],
        "train_seconds": metrics[-1]["time"] - metrics[0]["time"] if metrics else 0.0,
    }
    return str(write_report(load_run_config(run_dir), report)["report"])


def load_run_config(run_dir: str) -> Any:
    """The resolved run configuration saved at run_dir/config.yaml."""
    from rlax_tasks.config import load_config
    from rlax_tasks.rundir import storage
    from rlax_tasks.rundir.paths import run_paths

    path = run_paths(run_dir).config
    if not storage.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    return load_config(path)


def runs_to_evaluate(roots: list[str], active_within_s: float) -> list[dict[str, Any]]:
    """Runs under ``roots`` with a committed weight version not evaluated yet and activity
    (metrics or status) within ``active_within_s``: [{"run_dir", "version"}]."""
    from rlax_tasks.rundir import storage
    from rlax_tasks.rundir.paths import run_paths

    out = []
    now = time.time()
    for root in roots:
        for name in storage.list_children(root):
            run_dir = storage.join(root, name)
            paths = run_paths(run_dir)
            if not re.match(RUN_ID_PATTERN, name) or not storage.exists(paths.config):
                continue
            status = read_status(run_dir) or {}
            updated = float(status.get("updated") or 0.0)
            metrics = paths.metrics
            if not storage.is_gcs(metrics) and os.path.exists(metrics):
                updated = max(updated, os.stat(metrics).st_mtime)
            if now - updated > active_within_s:
                continue
            version = newest_version(run_dir)
            done = paths.eval_results(version)
            if version is not None and not storage.exists(done):
                out.append({"run_dir": run_dir, "version": version})
    return out


# --------------------------------------------------------------------------- janitor
def orphaned_slices(slices: list[dict[str, Any]], grace_s: float) -> list[dict[str, Any]]:
    """The slices (handle dicts) whose run is not active: no status.json, a state outside
    ACTIVE_STATES, or no status update within ``grace_s``. A slice records its run root and
    run id in its spec labels / handle root."""
    out = []
    now = time.time()
    for handle in slices:
        run_dir = slice_run_dir(handle)
        status = read_status(run_dir) if run_dir else None
        active = (
            status is not None
            and status.get("state") in ACTIVE_STATES
            and now - float(status.get("updated") or 0.0) <= grace_s
        )
        if not active:
            out.append(handle)
    return out


def slice_run_dir(handle: dict[str, Any]) -> str | None:
    """run_root/<run_id> of a slice, from the handle's label and its backend's run root
    (annotated by the janitor as "run_root"), or None when unknown."""
    from rlax_tasks.compute import RUN_ID_LABEL
    from rlax_tasks.rundir import storage

    run_id = (handle.get("spec") or {}).get("labels", {}).get(RUN_ID_LABEL)
    run_root = handle.get("run_root")
    if not run_id or not run_root:
        return None
    return storage.join(run_root, run_id)


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
    from rlax_tasks.airflow import ProvisionSliceOperator

    return ProvisionSliceOperator(
        task_id=task_id,
        name=name,
        accelerator_type=accelerator_type,
        runtime_version=runtime_version,
        **_managed_slice_args(run_root, run_id),
        **kw,
    )


def provision_slices(task_id: str, run_root: str, slices: Any, run_id: Any, **kw: Any):
    """A ProvisionSlicesOperator for a run's slices (``plan_slices``; an XComArg from plan),
    labelled for the janitor: its output holds each role's handle (``output["trainer"]``) and
    ``output["all"]``."""
    from rlax_tasks.airflow import ProvisionSlicesOperator

    return ProvisionSlicesOperator(
        task_id=task_id, slices=slices, **_managed_slice_args(run_root, run_id), **kw
    )


def _managed_slice_args(run_root: str, run_id: Any) -> dict[str, Any]:
    """The backend of ``run_root`` and the labels by which the janitor finds a run's slices."""
    from rlax_tasks.compute import MANAGED_LABEL, RUN_ID_LABEL

    return {
        "backend": backend_name(),
        "backend_settings": backend_settings(run_root),
        "labels": {MANAGED_LABEL: "true", RUN_ID_LABEL: run_id},
    }


def sibling_grace_s() -> float:
    return float(os.environ.get("RLAX_SIBLING_GRACE_S") or 600)


def job(task_id: str, run_root: str, slice_handle: Any, argv: Any, env: Any = None, **kw):
    """An RlaxJobOperator running ``rlax <argv>`` on ``slice_handle`` (deferrable)."""
    from rlax_tasks.airflow import RlaxJobOperator

    kw.setdefault("sibling_grace_s", sibling_grace_s())
    return RlaxJobOperator(
        task_id=task_id,
        backend=backend_name(),
        backend_settings=backend_settings(run_root),
        slice_handle=slice_handle,
        argv=argv,
        env=env or {},
        **kw,
    )


def teardown(task_id: str, run_root: str, slice_handle: Any, **kw):
    """A TeardownSliceOperator (idempotent) for ``slice_handle``."""
    from rlax_tasks.airflow import TeardownSliceOperator

    return TeardownSliceOperator(
        task_id=task_id,
        backend=backend_name(),
        backend_settings=backend_settings(run_root),
        slice_handle=slice_handle,
        **kw,
    )


def mapped_jobs(
    task_id: str, run_root: str, slice_handle: Any, argvs: Any, env: Any = None, **kw: Any
):
    """RlaxJobOperator mapped over ``argvs`` (one job per command line) on one slice."""
    from rlax_tasks.airflow import RlaxJobOperator

    kw.setdefault("sibling_grace_s", sibling_grace_s())
    return RlaxJobOperator.partial(
        task_id=task_id,
        backend=backend_name(),
        backend_settings=backend_settings(run_root),
        slice_handle=slice_handle,
        env=env or {},
        **kw,
    ).expand(argv=argvs)


def mapped_jobs_with_env(task_id: str, run_root: str, jobs: Any, **kw: Any):
    """RlaxJobOperator mapped over ``jobs``: [{"argv", "env", "slice_handle", "hosts"}], one
    job each (each worker with its own devices, on its own slice and host)."""
    from rlax_tasks.airflow import RlaxJobOperator

    kw.setdefault("sibling_grace_s", sibling_grace_s())
    return RlaxJobOperator.partial(
        task_id=task_id,
        backend=backend_name(),
        backend_settings=backend_settings(run_root),
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
    from rlax_tasks.airflow import job_name_for, start_jobs

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
                backend_name(),
                backend_settings(plan["run_root"]),
                slices[where[planned]["slice"]],
                {name: job_argv},
                envs[planned],
                hosts=where[planned]["hosts"],
            )
        )
    return started


SERVICE_COMMANDS = ("ps", "trainer", "worker")


def service_job_handles(slice_handles: Any) -> list[dict[str, Any]]:
    """Handles of the service jobs (ps, trainer, workers) started on a slice (or each of a list
    of slices), read from each job's status directory ``<slice root>/jobs/<job>/spec.json``."""
    handles = slice_handles if isinstance(slice_handles, list) else [slice_handles]
    return [job for handle in handles for job in _service_jobs(handle)]


def _service_jobs(slice_handle: dict[str, Any]) -> list[dict[str, Any]]:
    from rlax_tasks.rundir import storage

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
