"""rlax_curate: curates raw prompt files into a training dataset and publishes it as an Asset."""

from __future__ import annotations

from airflow.sdk import Param, task

from rlax_tasks.airflow import factories as rc
from rlax_tasks.airflow import settings
from rlax_tasks.airflow.params import DATA_FORMATS, accelerator_type_param, dag_run_run_id
from rlax_tasks.airflow.run_status import write_status
from rlax_tasks.compute.types import slice_name
from rlax_tasks.plan.slices import single_host_slice

DOC = """
### rlax_curate
Runs `rlax curate` (read the inputs in their `format` — gsm8k, math, dapo, messages, code,
columns or the row schema — validate, deduplicate, decontaminate against the eval sets, optional
pass-rate filter, date split) on a compute slice, writes `<out>/train.parquet` and
`<out>/test.parquet`, and publishes the Asset **rlax_curated_dataset** with
`{"path": "<out>/train.parquet", "verifier": "math" | "code"}` — `rlax_train` is scheduled on
it and trains on that file.
The slice is deleted by a teardown task whatever happens.
"""


@rc.rlax_dag(
    "rlax_curate",
    schedule=None,
    tags=["data"],
    doc_md=DOC,
    params={
        "inputs": Param(
            [], type="array", items={"type": "string"}, minItems=1,
            description="JSONL/Parquet/CSV files or directories (local or gs://)",
        ),
        "format": Param(
            "rlax", type="string", enum=list(DATA_FORMATS),
            description="input layout (docs/design.md §11): gsm8k, math, dapo, messages, code, "
            "columns (with the columns mapping) or rlax (the row schema)",
        ),
        "columns": Param(
            {}, type="object",
            description='format columns: field -> column, e.g. {"prompt": "question", '
            '"answer": "final_answer"}',
        ),
        "out": Param(
            "", type="string",
            description="output directory; empty = <run_root>/datasets/<dag run id>",
        ),
        "eval_sets": Param(
            [], type="array", items={"type": "string"},
            description="evaluation sets to decontaminate against",
        ),
        "split_date": Param(
            None, type=["null", "string"], format="date",
            description="rows before this ISO date go to train, the rest to test",
        ),
        "accelerator_type": accelerator_type_param(),
        "run_root": Param(settings.default_run_root(), type="string", minLength=1),
    },
)  # fmt: skip
def rlax_curate():
    @task
    def plan(params: dict, run_id: str) -> dict:
        from rlax_tasks.rundir import storage

        rid = dag_run_run_id(run_id)
        out = params["out"] or storage.join(params["run_root"], "datasets", rid)
        argv = ["curate", *params["inputs"], "--out", out, "--format", params["format"]]
        if params.get("columns"):
            argv += ["--columns", ",".join(f"{k}={v}" for k, v in params["columns"].items())]
        # the janitor leaves this run's slice alone while the status is fresh
        write_status(storage.join(settings.default_run_root(), rid), "running", run_id)
        for e in params["eval_sets"]:
            argv += ["--eval-set", e]
        if params.get("split_date"):
            argv += ["--split-date", params["split_date"]]
        from rlax_tasks.data.formats import get_format

        # a bad format/columns or slice fails here, naming it, before anything is provisioned
        verifier = get_format(params["format"], params.get("columns") or None).verifier
        accelerator_type, runtime_version = single_host_slice(
            params.get("accelerator_type"), settings.backend_name()
        )
        return {
            "slice": slice_name(rid, "curate"),
            "accelerator_type": accelerator_type,
            "runtime_version": runtime_version,
            "run_id": rid,
            "argv": argv,
            "out": out,
            "verifier": verifier,
        }

    @task(outlets=[rc.CURATED_DATASET])
    def publish(p: dict, outlet_events=None) -> str:
        from rlax_tasks.rundir import storage

        path = storage.join(p["out"], "train.parquet")
        if not storage.exists(path):
            raise FileNotFoundError(f"rlax curate wrote no {path}")
        outlet_events[rc.CURATED_DATASET].extra = {"path": path, "verifier": p["verifier"]}
        return path

    p = plan()
    root, slice_, cleanup = rc.single_slice(p)
    curate = rc.job("curate", root, slice_.output, p["argv"])
    done = publish(p)
    p >> slice_ >> curate >> done >> cleanup


rlax_curate()
