"""The launch steps `rlax run` and the rlax_train DAG share, in the order both take them.

``check_run`` (memory plan and datasets, before anything starts), ``prepare_run_dir`` (base
model, resolved config), ``plan_jobs`` (the TrainingPlan: every job's command line,
environment and addresses).
Each launcher adds its own: `rlax run` its lock and supervisor, the DAG its Params and slices."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from rlax_tasks.config import RunConfig, save_resolved
from rlax_tasks.plan.compilation_cache import cache_env
from rlax_tasks.plan.memory_plan import MemoryPlan, memory_plan
from rlax_tasks.plan.placement import (
    COLOCATED,
    describe,
    is_colocated,
    job_env,
    replica_job,
    trainer_job,
)
from rlax_tasks.plan.preflight import check_datasets
from rlax_tasks.plan.run_plan import Job, TrainingPlan
from rlax_tasks.plan.topology import (
    Ports,
    Topology,
    WorkerSlices,
    plan_topology,
    write_workers_file,
)
from rlax_tasks.process.parent_death import dies_with_parent
from rlax_tasks.rundir.paths import run_paths

log = logging.getLogger(__name__)


def check_run(cfg: RunConfig) -> MemoryPlan:
    """The memory plan (logged with the placement) and the datasets, before anything starts.

    PlanDoesNotFit names the job and what to change, DatasetError the file and row, ValueError
    model.path when the model's shapes cannot be read.
    """
    plan = memory_plan(cfg, offline=False)
    log.info("run %s\n%s\n%s", cfg.run_id, describe(cfg), plan.format(problems=False))
    plan.check()
    check_datasets(cfg)
    return plan


def ensure_model(cfg: RunConfig) -> None:
    """Builds the base model by the supervised warm-up, or imports the packaged model, when the
    config asks for it and model.path does not hold it yet."""
    if cfg.model.import_if_missing:
        from rlax_tasks.models.packaged import ensure_packaged_model  # torch: only to import

        ensure_packaged_model(cfg.model.import_if_missing, cfg.model.path)
        return
    if not cfg.model.warmup_if_missing:
        return
    from rlax_tasks.warmup.base_model import is_cached

    # reuses the cached model when its recipe fingerprint matches, rebuilds it otherwise
    parent, name = os.path.split(os.path.abspath(cfg.model.path))
    if is_cached(parent, name):
        log.info("base model %s is cached: reusing it", cfg.model.path)
        return
    # the warm-up trains with JAX: in a process of its own on the trainer's devices, gone before
    # the run's jobs start, so that the caller (rlax run, a DAG task) never starts a backend
    env = {**os.environ, **job_env(cfg, trainer_job(cfg))}
    # (dies with this process: a caller killed meanwhile leaves no warm-up holding the devices)
    argv = dies_with_parent([sys.executable, "-m", "rlax_tasks.warmup.base_model", parent, name])
    code = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL).returncode
    if code != 0:
        raise ValueError(
            f"model.path {cfg.model.path}: the base model's warm-up failed (exit {code}; its "
            "error is printed above)"
        )


def prepare_run_dir(cfg: RunConfig, allow_config_change: bool) -> str:
    """Builds the base model if asked and saves the resolved config (ConfigChangeError: a resume
    that changes training without ``allow_config_change``); returns config.yaml's path."""
    ensure_model(cfg)
    return save_resolved(cfg, allow_config_change)


def plan_jobs(
    cfg: RunConfig,
    steps: int,
    config_path: str,
    plan: MemoryPlan,
    token: str,
    ports: Ports | None = None,
    env: dict[str, str] | None = None,
    worker_slices: WorkerSlices | None = None,
) -> TrainingPlan:
    """The run's plan (``plan_topology``; ``ports=None``: published addresses) with the
    compilation cache and ``env`` in each job's environment; writes workers.json for the
    controller."""
    topology = plan_topology(
        cfg, steps, config_path, ports, plan.ps.argv(), token,
        base_env={**cache_env(cfg), **(env or {})}, worker_slices=worker_slices,
    )  # fmt: skip
    if not is_colocated(cfg):
        write_workers_file(cfg, topology)
    return training_plan(cfg, steps, config_path, topology)


def training_plan(cfg: RunConfig, steps: int, config_path: str, topology: Topology) -> TrainingPlan:
    """``topology`` as the run's TrainingPlan: its jobs by role (a colocated run's one job is
    the controller's, the job whose exit ends the run), no held-out job, no slices yet."""
    jobs = {job.name: job for job in topology.jobs}
    if is_colocated(cfg):
        ps, trainer, workers = Job.unplanned("ps"), Job.unplanned("trainer"), ()
        controller = jobs[COLOCATED]
    else:
        ps, trainer, controller = jobs["ps"], jobs["trainer"], jobs["controller"]
        workers = tuple(jobs[w] for w in topology.workers)
    replicas = tuple(jobs[replica_job(r)] for r in range(1, cfg.paramserver.replicas))
    return TrainingPlan(
        run_id=cfg.run_id, run_root=cfg.run_root, run_dir=cfg.run_dir, config_path=config_path,
        steps=steps, ps_url=topology.ps_url, done_marker=run_paths(cfg.run_dir).done, ps=ps,
        trainer=trainer, workers=workers, controller=controller,
        heldout=Job.unplanned("heldout"),
        # the evaluations before and after training: on the trainer's devices, free by then
        eval_env=dict((controller if is_colocated(cfg) else trainer).env),
        coordinator=topology.coordinator, ps_replicas=() if is_colocated(cfg) else replicas,
    )  # fmt: skip
