"""rlax_train's plan task: its Params → the run config → the slices → `rlax run`'s launch
steps → the run's TrainingPlan (docs/design.md §10), whose ``to_dict`` is the task's XCom.

The scheduler imports this module when it parses the DAGs: the run config and the launch steps
load inside ``plan_training``, which runs in a task."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from rlax_tasks.airflow.compute_connection import compute_backend
from rlax_tasks.airflow.params import (
    RUN_ID_PATTERN,
    TrainParams,
    config_from_params,
    dag_run_run_id,
)
from rlax_tasks.airflow.settings import default_run_root
from rlax_tasks.compute import SliceSpec
from rlax_tasks.compute.cloud_tpu import local_run_root_error
from rlax_tasks.compute.types import slice_name
from rlax_tasks.plan.run_plan import TRAINER_SLICE, Job, SlicePlan, TrainingPlan
from rlax_tasks.plan.slices import PlanError, run_slices
from rlax_tasks.rundir import storage

log = logging.getLogger(__name__)


def slice_provisioning(params: TrainParams) -> dict[str, Any]:
    """How the run's slices are bought and joined to the project (the capacity, service_account,
    network and subnetwork Params), checked as a SliceSpec checks them; PlanError names the
    Param."""
    try:
        fields: dict[str, Any] = SliceSpec.capacity_fields(params.capacity or "spot")
    except ValueError as e:
        raise PlanError(f"capacity: {e}") from None
    for name in ("service_account", "network", "subnetwork"):
        fields[name] = (getattr(params, name) or "").strip()
    try:
        SliceSpec(name="check", **fields)
    except ValueError as e:
        raise PlanError(str(e)) from None
    return fields


def plan_slices(
    run_id: str,
    slices: list[tuple[str, str, str]],
    provisioning: Mapping[str, Any],
    evaluation: str = TRAINER_SLICE,
) -> tuple[SlicePlan, ...]:
    """The slices of a run (``slices``: ``rlax_tasks.plan.slices.run_slices``; ``provisioning``:
    ``slice_provisioning``), the one of role ``evaluation`` marked for the evaluations."""
    return tuple(
        SlicePlan(
            role=role, name=slice_name(run_id, role), accelerator_type=kind,
            runtime_version=runtime, **provisioning,
            evaluation=role == evaluation and evaluation != TRAINER_SLICE,
        )
        for role, kind, runtime in slices
    )  # fmt: skip


def plan_training(
    params: Mapping[str, Any], dag_run_id: str, dataset: str = "", verifier: str = "math"
) -> TrainingPlan:
    """The rlax_train plan task's plan: every job's command line, environment, slice and hosts.

    Refuses, with PlanError naming the Param or field, before anything is written or
    provisioned.

    Args:
        params: the DAG run's Params (``TrainParams``'s fields).
        dag_run_id: the DAG run's id (the run id when the run_id Param is empty).
        dataset: a curated file (from the rlax_curate Asset) replacing the preset's datasets.
        verifier: how its rows are scored (``math`` or ``code``).

    Returns:
        The TrainingPlan; the task returns its ``to_dict()``.
    """
    # the run config loads JAX-free but heavy: in the task, never when the scheduler parses
    from rlax_tasks.config import ConfigChangeError
    from rlax_tasks.plan import launch, slices
    from rlax_tasks.plan.memory_plan import PlanDoesNotFit
    from rlax_tasks.plan.preflight import DatasetError
    from rlax_tasks.services.http import run_token

    p = TrainParams.from_params(params)
    run_root = p.run_root or default_run_root()
    backend, settings = compute_backend(run_root)
    run_id = p.run_id or dag_run_run_id(dag_run_id)
    if not re.match(RUN_ID_PATTERN, run_id):
        raise PlanError(f"run_id: {run_id!r} must be lowercase letters, digits, '_', '-'")
    trainer_type = p.accelerator_type or "cpu"
    worker_type = p.worker_accelerator_type or None
    layout = slices.worker_slice_layout(worker_type, p.worker_slices, backend)
    cfg = config_from_params(
        p, run_root=run_root, run_id=run_id, dataset=dataset, verifier=verifier, workers=layout
    )
    runtime_version = slices.check_slice(
        trainer_type, p.runtime_version, cfg.trainer.hosts, backend
    )
    slices.check_worker_slices(cfg, backend, layout)
    evaluation = slices.evaluation_slice(cfg, backend, layout)
    provisioning = slice_provisioning(p)
    if backend == "cloud_tpu":
        slices.check_slice_memory(cfg, trainer_type, worker_type)
    steps = p.steps or cfg.trainer.total_steps
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
        config_path = launch.prepare_run_dir(cfg, p.allow_config_change)
    except ConfigChangeError as e:
        raise PlanError(f"{e} (set the allow_config_change Param to accept it)") from None
    plan = launch.plan_jobs(  # addresses are published under run_dir/services/
        cfg, int(steps), config_path, memory, run_token(), worker_slices=layout
    )
    # a run resumed after it completed (more steps) is not complete any more
    storage.delete_prefix(plan.done_marker)
    kinds = run_slices(trainer_type, runtime_version, worker_type, layout, backend)
    return dataclasses.replace(
        plan,
        slices=plan_slices(cfg.run_id, kinds, provisioning, evaluation),
        runtime_version=runtime_version,
        heldout=_heldout_during_training(cfg, config_path, int(steps)),
        # the evaluations take the first worker's devices when they run on its slice
        eval_env=plan.eval_env if evaluation == TRAINER_SLICE else dict(plan.workers[0].env),
    )


def _heldout_during_training(cfg: Any, config_path: str, steps: int) -> Job:
    """The heldout task's job: `rlax heldout` every eval.every_steps versions beside training,
    on host 0 of the trainer slice on devices of its own (placement.evaluator); unplanned (the
    task is skipped) without them or when no version before the last is due: a cpu run
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
        return Job.unplanned("heldout")
    argv = heldout_argv(config_path, base=False, every=every, last=None, after=after)
    log.info("held-out pass@k every %d steps during training: rlax %s", every, " ".join(argv))
    return Job("heldout", argv, heldout_env(cfg))
