"""rlax_nightly_eval: every night, held-out pass@k of the newest weights of every active run."""

from __future__ import annotations

import logging

from airflow.sdk import task

from rlax_tasks.airflow import eval_planning as ev
from rlax_tasks.airflow import factories as rc
from rlax_tasks.airflow import settings
from rlax_tasks.airflow.params import accelerator_type_param, dag_run_run_id, silence_param
from rlax_tasks.airflow.run_status import write_status
from rlax_tasks.compute.types import slice_name
from rlax_tasks.plan.slices import single_host_slice

log = logging.getLogger(__name__)

DOC = """
### rlax_nightly_eval
At 02:00 every day (no catch-up): for each run under `RLAX_RUN_ROOTS` that was active within
`active_hours` and has a committed weight version (`weights/v<N>`) not evaluated yet, runs
`rlax eval` of that version on the run's held-out set into `<run>/eval/v<N>/` (the RLAX dashboard
plots pass@k from there), appends a row (date, version, pass@k...) to each evaluated run's
history `<run>/eval/history.jsonl` (**record_history**, also when some evaluations failed; the
dashboard shows it on the run's page), then publishes the Asset **rlax_nightly_eval** listing what
was evaluated. All evaluations share one slice, deleted by a teardown task.
"""


@rc.rlax_dag(
    "rlax_nightly_eval",
    schedule="0 2 * * *",
    tags=["evaluation"],
    doc_md=DOC,
    params={
        "active_hours": silence_param(24, "hours"),
        "accelerator_type": accelerator_type_param(),
    },
)
def rlax_nightly_eval():
    @task
    def plan(params: dict, run_id: str, dag_run=None) -> dict:
        accelerator_type, runtime_version = single_host_slice(
            params.get("accelerator_type"), settings.backend_name()
        )
        todo = ev.runs_to_evaluate(settings.run_roots(), 3600.0 * params["active_hours"])
        argvs = []
        for item in todo:
            cfg = ev.load_run_config(item["run_dir"])
            argvs.append(ev.eval_argv(cfg, item["version"], ev.eval_dataset_file(cfg)))
        rid = dag_run_run_id(f"nightly-{run_id}")
        # the janitor leaves this run's slice alone while the status is fresh
        write_status(
            f"{settings.default_run_root()}/{rid}", "running", run_id, dag_id=dag_run.dag_id
        )
        log.info("evaluating %d run(s): %s", len(todo), todo)
        return {
            "runs": todo,
            "argvs": argvs,
            "slice": slice_name(rid, "eval"),
            "run_id": rid,
            "accelerator_type": accelerator_type,
            "runtime_version": runtime_version,
        }

    @task
    def eval_argvs(p: dict) -> list[list[str]]:
        # a task of its own: Airflow maps only over a task's whole return value
        return p["argvs"]

    @task(trigger_rule="all_done")  # the evaluations that succeeded, whatever the others did
    def record_history(p: dict, run_id: str) -> list[dict]:
        return ev.record_nightly_history(p["runs"], run_id)

    @task(outlets=[rc.NIGHTLY_EVAL])
    def publish(p: dict, outlet_events=None) -> list[dict]:
        outlet_events[rc.NIGHTLY_EVAL].extra = {"evaluated": p["runs"]}
        return p["runs"]

    p = plan()
    root, slice_, cleanup = rc.single_slice(p)
    evals = rc.mapped_jobs("evaluate", root, slice_.output, eval_argvs(p))
    p >> slice_ >> evals >> publish(p) >> cleanup
    evals >> record_history(p)


rlax_nightly_eval()
