"""rlax_train: one RL training run as Airflow tasks — curate → provision → services → eval →
teardown — triggered from the UI with a validated Params form (or by a curated dataset)."""

from __future__ import annotations

from airflow.sdk import task

from rlax_tasks.airflow import eval_planning as ev
from rlax_tasks.airflow import factories as rc
from rlax_tasks.airflow import settings
from rlax_tasks.airflow.params import train_params
from rlax_tasks.airflow.plan_task import plan_training
from rlax_tasks.airflow.run_status import write_status
from rlax_tasks.plan.run_plan import TrainingPlan
from rlax_tasks.plan.slices import PlanError

# the evaluations' watchers poll more often than the services' (10 s): an evaluation is short
# next to training, and the run waits on each (a small model's is done in seconds)
EVAL_POLL_S = 3.0

DOC = """
### rlax_train
One RLAX run (docs/design.md §2) with the compute backend `RLAX_BACKEND` (default `local`):

1. **plan** — validates the Params into the run configuration (`preset` + overrides; an invalid
   field fails the run at once, naming it), logs each job's devices (`placement`) and the memory
   per device, refuses a plan that does not fit the accelerator named there, writes
   `<run_root>/<run_id>/config.yaml`, builds the tiny base model when the preset asks for it,
   picks the services' addresses. On `cloud_tpu` it also refuses, before anything is
   provisioned, an `accelerator_type` that is not a Cloud TPU type, a malformed
   `runtime_version` (empty = the default image of the accelerator's family) and a type whose
   hosts differ from the run config's `trainer.hosts`; on `ray` a type that is not a Ray slice
   type (`cpu`, `gpu-8`, `2xgpu-8`, a Cloud TPU type) or whose hosts differ. When the run was
   triggered by the **rlax_curated_dataset** Asset, the curated file replaces the preset's data.
2. **provision** (setup) — the run's slices at once: the trainer slice (the trainer over all
   its hosts, the parameter server and the controller beside host 0) and, with
   `worker_accelerator_type`, `worker_slices` slices of that type with one worker per host
   (else the workers run on the trainer slice). Services bind their host's address and publish
   it under `<run>/services/`; clients find each other there, also after a re-provision.
3. **base_eval** / **evaluate_base** / **record_base_eval** — the held-out evaluation of the
   starting weights into `<run>/eval/v0/` (the "before" of the run; the same `rlax eval` as the
   final one, on the trainer's devices before training takes them). Cached per run root under
   `<run_root>/base-evals/<fingerprint>/` by model files, held-out data and evaluation settings:
   a resumed or repeated run copies it (evaluate_base is skipped). A broken evaluation setting
   fails the run here, before hours of training.
4. **start_services** starts every job at once; **ps**, **trainer**, **worker** (mapped over
   the worker index) and **controller** watch them — long-running `rlax` jobs watched by
   deferrable triggers. A preempted or killed job is retried and resumes from the newest
   checkpoint, controller snapshot and weight mirror; a configuration error fails without
   retries. The service watchers end (stopping their job) once the controller has succeeded,
   and fail (stopping it too) once another job's task has failed for good: the run does not
   wait forever, holding its slices, for a job nobody will restart.
   A colocated run (`placement.mode: colocated`, the tiny preset's) is one job — trainer,
   sampler, parameter server and controller in one process — watched by **controller**; the
   ps, trainer and worker tasks are skipped.
   **heldout** — with `eval.every_steps` and devices of its own (`placement.evaluator`),
   `rlax heldout` evaluates every N-th version beside training on host 0 of the trainer slice
   (into `<run>/eval/heldout_scores.jsonl`; the report plots pass@k per step); skipped
   without them.
5. **finish** — once the controller reached `steps`, stops whatever still runs.
6. **evaluate** — `rlax eval` of the final weights into `<run>/eval/v<N>/` (the "after"; the
   RLAX dashboard shows both, and compares runs).
7. **teardown** — deletes the slices, always (all_done), and records the final state in
   `<run>/status.json` with this DAG run's id (read by the RLAX dashboard, which links the DAG
   run, and the janitor).
"""


@rc.rlax_dag(
    "rlax_train",
    schedule=[rc.CURATED_DATASET],
    max_active_runs=4,
    tags=["training"],
    doc_md=DOC,
    params=train_params(),
)
def rlax_train():
    @task(retries=0)
    def plan(params: dict, run_id: str, dag_run=None, triggering_asset_events=None) -> dict:
        from airflow.sdk.exceptions import AirflowFailException

        dataset, verifier = "", "math"
        for events in (triggering_asset_events or {}).values():
            for event in events:
                dataset = (event.extra or {}).get("path", dataset)
                verifier = (event.extra or {}).get("verifier", verifier)
        try:
            p = plan_training(dict(params), run_id, dataset, verifier)
        except (ValueError, FileNotFoundError) as e:  # user mistakes: retrying cannot help
            raise AirflowFailException(str(e)) from None
        write_status(p.run_dir, "running", run_id, dag_id=dag_run.dag_id, steps=p.steps)
        return p.to_dict()  # the tasks read its fields: p["trainer"], p["run_dir"], ...

    @task
    def finish(p: dict, slice_handles: list) -> None:
        """The controller reached `steps`: stop the services (they run until told)."""
        from rlax_tasks.compute import get_backend
        from rlax_tasks.rundir import storage

        plan = TrainingPlan.from_dict(p)
        storage.write_bytes(plan.done_marker, b"")  # the watchers stop their jobs
        backend = get_backend(settings.backend_name(), **settings.backend_settings(plan.run_root))
        for handle in rc.service_job_handles(slice_handles):
            backend.stop_job(handle)

    @task
    def base_eval(p: dict) -> dict:
        """Copies the cached evaluation of the starting weights into eval/v0, or plans one."""
        from airflow.sdk.exceptions import AirflowFailException

        try:
            return ev.prepare_base_eval(p["run_dir"])
        except PlanError as e:  # no held-out dataset: retrying cannot help
            raise AirflowFailException(str(e)) from None

    @task(trigger_rule="none_failed")  # also after a skipped evaluate_base (a cache hit)
    def record_base_eval(base: dict) -> None:
        ev.record_base_eval(base)

    @task
    def eval_argv(p: dict) -> list[str]:
        cfg = ev.load_run_config(p["run_dir"])
        version = ev.newest_version(p["run_dir"])
        if version is None:
            raise FileNotFoundError(f"{p['run_dir']}: no committed weights to evaluate")
        return ev.eval_argv(cfg, version, ev.eval_dataset_file(cfg))

    @task
    def report(p: dict) -> str:
        """eval/report.md and its plots: held-out pass@k before (v0) and after training."""
        return ev.write_run_report(p["run_dir"])

    @task
    def worker_jobs(p: dict, slices: dict) -> list[dict]:
        # a task of its own: Airflow maps only over a task's whole return value
        return rc.worker_jobs(TrainingPlan.from_dict(p), slices)  # each: its job and slice

    @task
    def replica_jobs(p: dict, slices: dict) -> list[dict]:
        # the parameter-server replicas beside ps (paramserver.replicas), mapped like workers
        return rc.replica_jobs(TrainingPlan.from_dict(p), slices)

    @task
    def start_services(p: dict, slices: dict) -> dict:
        """Starts every job before any watcher waits (dag.test() runs triggers one by one)."""
        return rc.start_services(TrainingPlan.from_dict(p), slices)

    @task(trigger_rule="all_done")
    def record_state(p: dict | None, dag_run=None, ti=None) -> str:
        if not p:  # plan failed: there is no run directory to record the state in
            return "failed"
        runs = ti.get_task_states(dag_id=dag_run.dag_id, run_ids=[dag_run.run_id])
        states = runs.get(dag_run.run_id, {})
        failed = sorted(k for k, v in states.items() if v in ("failed", "upstream_failed"))
        state = "failed" if failed else "succeeded"
        write_status(
            p["run_dir"], state, dag_run.run_id, dag_id=dag_run.dag_id, failed_tasks=failed
        )
        return state

    p = plan()
    root = p["run_root"]  # the run_root Param as plan resolved it: the slices' control directory
    # the trainer slice and the worker slices, as plan checked them (types, runtime versions)
    slices = rc.provision_slices("provision", root, p["slices"], p["run_id"])
    everything, h = slices.output, slices.output["trainer"]
    # the trainer slice's host 0, or under a trainer over several TPU hosts the first worker
    # slice's (libtpu runs no process on one host of a multi-host slice alone)
    on = slices.output["evaluation"]
    base = base_eval(p)  # beside provisioning: it needs no slice
    # the starting weights on the trainer's devices, before training takes them
    evaluate_base = rc.job(
        "evaluate_base", root, on, base["argv"], p["eval_env"], poll_interval_s=EVAL_POLL_S
    )
    started = start_services(p, everything)
    evaluate_base >> record_base_eval(base) >> started
    watch = {"started_jobs": started, "done_when": "controller", "done_marker": p["done_marker"]}
    # each watcher takes its job of the plan (an unplanned one: skipped, e.g. a colocated run's
    # ps and trainer, or heldout without devices of its own)
    ps = rc.planned_job("ps", root, h, p["ps"], **watch)
    ps_replicas = rc.mapped_planned_jobs("ps_replica", root, replica_jobs(p, everything), **watch)
    trainer = rc.planned_job("trainer", root, h, p["trainer"], **watch)
    workers = rc.mapped_planned_jobs("worker", root, worker_jobs(p, everything), **watch)
    controller = rc.planned_job("controller", root, h, p["controller"], **watch)
    heldout = rc.planned_job("heldout", root, h, p["heldout"], **watch)  # pass@k meanwhile
    stop = finish(p, everything["all"])
    final_eval = eval_argv(p)
    evaluate = rc.job("evaluate", root, on, final_eval, p["eval_env"], poll_interval_s=EVAL_POLL_S)
    cleanup = rc.teardown("teardown", root, everything["all"]).as_teardown(setups=slices)
    p >> slices >> started >> [ps, ps_replicas, trainer, workers, controller, heldout]
    controller >> stop >> final_eval >> evaluate >> report(p) >> cleanup
    [ps, ps_replicas, trainer, workers, heldout] >> cleanup
    cleanup >> record_state(p)


rlax_train()
