"""Every DAG under dags/ imports cleanly, with owners, tags, retries, docs and validated Params."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
from airflow.sdk.exceptions import ParamValidationError

from tests.dags.conftest import DAGS, REPO

EXPECTED = {"rlax_train", "rlax_nightly_eval", "rlax_curate", "rlax_janitor"}


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=DAGS)


def test_all_dags_import_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert EXPECTED <= set(dagbag.dag_ids)


_FRESH_DAGBAG = """
import json, os, sys
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder="dags")  # Airflow 3: no include_examples (LOAD_EXAMPLES is off)
dags = os.path.abspath("dags")
print(json.dumps({
    "errors": {os.path.basename(k): v for k, v in bag.import_errors.items()},
    "dag_ids": sorted(bag.dag_ids),
    "dags_on_path": [p for p in sys.path if os.path.abspath(p or ".") == dags],
    "heavy": [m for m in ("jax", "flax", "rlax_tasks.config") if m in sys.modules],
}))
"""


def test_dags_parse_in_a_plain_python_process(tmp_path):
    """A user's `DagBag(dag_folder="dags")` from a fresh interpreter: only the installed
    package on sys.path (-I: no PYTHONPATH, no cwd, no user site), dags/ not on it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON"))}
    env.update(
        AIRFLOW_HOME=str(tmp_path / "airflow-home"),  # its own dags/ and plugins/ folders
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", _FRESH_DAGBAG],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])  # Airflow may log lines before it
    assert result["dags_on_path"] == []
    assert result["errors"] == {}
    assert set(result["dag_ids"]) == EXPECTED
    assert result["heavy"] == []  # parsing the DAGs stays light (the scheduler parses them)


@pytest.mark.parametrize("dag_id", sorted(EXPECTED))
def test_owner_tags_retries_docs(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    assert dag.tags and "rlax" in dag.tags
    assert dag.doc_md and dag_id in dag.doc_md
    assert dag.catchup is False
    for t in dag.tasks:
        assert t.owner == "rlax", t.task_id
        assert t.retry_delay.total_seconds() > 0, t.task_id
    assert any(t.retries >= 1 for t in dag.tasks)


def test_train_params_validate_and_reject_bad_values(dagbag):
    dag = dagbag.dags["rlax_train"]
    resolved = dag.params.validate()
    assert resolved["preset"] == "tiny-arith" and resolved["num_workers"] is None  # preset's
    assert resolved["worker_accelerator_type"] is None and resolved["worker_slices"] == 1
    bad_values = {
        "preset": "no-such-preset",
        "algorithm": "sgd",
        "reload_every": 0,
        "max_staleness": 0,
        "num_workers": 0,
        "worker_slices": 0,
        "steps": -1,
        "run_id": "Bad/Id",
    }
    for key, value in bad_values.items():
        params = copy.deepcopy(dag.params)
        with pytest.raises(ParamValidationError, match=f"param {key}:"):
            params[key] = value
            params.validate()
    ok = copy.deepcopy(dag.params)
    ok["algorithm"] = "dapo"
    ok["max_staleness"] = None
    assert ok.validate()["algorithm"] == "dapo"


def test_train_runtime_version_param(dagbag):
    """null (the default) = the accelerator family's default image; a given one must look like
    a runtime version (the plan task checks it again, with the accelerator type)."""
    dag = dagbag.dags["rlax_train"]
    assert dag.params.validate()["runtime_version"] is None
    ok = copy.deepcopy(dag.params)
    ok["runtime_version"] = "v2-alpha-tpuv5-lite"
    assert ok.validate()["runtime_version"] == "v2-alpha-tpuv5-lite"
    for bad in ("", "V2-alpha", "-v2", "v2 alpha", "v2_alpha", 5):
        params = copy.deepcopy(dag.params)
        with pytest.raises(ParamValidationError, match="param runtime_version:"):
            params["runtime_version"] = bad
            params.validate()


def test_algorithm_choices_match_the_objective_presets():
    from rlax_tasks.airflow import params
    from rlax_tasks.algorithms.config import PRESETS

    assert set(params.ALGORITHMS) == set(PRESETS)


def test_data_format_choices_match_the_dataset_formats():
    from rlax_tasks.airflow import params
    from rlax_tasks.data.formats import FORMAT_NAMES

    assert params.DATA_FORMATS == FORMAT_NAMES


def test_the_train_form_and_the_typed_params_name_the_same_params(dagbag):
    """Every Param of the rlax_train form is a TrainParams field and back: the plan task reads
    the form into the record (a Param added to one only would be lost or refused)."""
    import dataclasses

    from rlax_tasks.airflow.params import TrainParams

    fields = [f.name for f in dataclasses.fields(TrainParams)]
    assert sorted(dagbag.dags["rlax_train"].params) == sorted(fields)
    validated = dagbag.dags["rlax_train"].params.validate()
    assert TrainParams.from_params(validated).preset == validated["preset"]


def test_one_list_of_presets():
    """The presets package owns the list (light: the DAGs' form names them without loading the
    run config); the config's loader and the form use that one function."""
    import rlax_tasks.config
    from rlax_tasks import presets
    from rlax_tasks.airflow.params import train_params
    from rlax_tasks.config import loading

    assert loading.preset_names is rlax_tasks.config.preset_names is presets.preset_names
    assert train_params()["preset"].schema["enum"] == presets.preset_names()


def test_train_graph_shape(dagbag):
    dag = dagbag.dags["rlax_train"]
    ids = set(dag.task_ids)
    assert {"plan", "provision", "base_eval", "evaluate_base", "record_base_eval",
            "start_services", "ps", "trainer", "worker", "controller", "finish", "evaluate",
            "report", "teardown", "record_state"} <= ids  # fmt: skip
    assert dag.get_task("report").upstream_task_ids == {"plan", "evaluate"}  # after the final eval
    assert "teardown" in dag.get_task("report").downstream_task_ids
    teardown = dag.get_task("teardown")
    assert teardown.is_teardown and teardown.trigger_rule == "all_done_setup_success"
    assert dag.get_task("provision").is_setup
    assert "teardown" in dag.get_task("controller").get_flat_relative_ids(upstream=False)
    assert dag.get_task("plan").retries == 0  # configuration errors never retry
    slices = dag.get_task("provision").slices  # checked by plan: types, runtime versions
    assert (slices.operator.task_id, slices.key) == ("plan", "slices")
    # the trainer runs on all of its slice's hosts; the workers each on their slice and host
    # each service watcher takes its job of the plan (argv, env, hosts): plan["<job>"]
    for job in ("ps", "trainer", "controller", "heldout"):
        planned = dag.get_task(job).job
        assert (planned.operator.task_id, planned.key) == ("plan", job)


def test_train_evaluates_the_starting_weights_before_training(dagbag):
    """base_eval (cache lookup; needs no slice) → evaluate_base (the `rlax eval` job on the
    trainer slice, skipped on a cache hit: an empty argv) → record_base_eval (also after a
    skip) → start_services: training starts once eval/v0 is there."""
    dag = dagbag.dags["rlax_train"]
    job = dag.get_task("evaluate_base")
    assert (job.argv.operator.task_id, job.argv.key) == ("base_eval", "argv")
    assert (job.env.operator.task_id, job.env.key) == ("plan", "eval_env")  # the final eval's too
    assert job.slice_handle.operator.task_id == "provision"
    assert dag.get_task("base_eval").upstream_task_ids == {"plan"}  # beside provisioning
    record = dag.get_task("record_base_eval")
    assert record.upstream_task_ids == {"base_eval", "evaluate_base"}
    assert record.trigger_rule == "none_failed"
    assert "record_base_eval" in dag.get_task("start_services").upstream_task_ids
    assert "evaluate_base" in dag.get_task("provision").get_flat_relative_ids(upstream=False)
    assert "teardown" in job.get_flat_relative_ids(upstream=False)


def test_nightly_records_each_runs_history(dagbag):
    dag = dagbag.dags["rlax_nightly_eval"]
    record = dag.get_task("record_history")
    assert record.trigger_rule == "all_done"  # the evaluations that succeeded, even if one failed
    assert record.upstream_task_ids == {"plan", "evaluate"}


@pytest.mark.parametrize("dag_id", ["rlax_curate", "rlax_nightly_eval"])
def test_curation_and_evaluation_provision_what_their_plan_checked(dagbag, dag_id):
    dag = dagbag.dags[dag_id]
    assert dag.params["accelerator_type"] == "cpu"
    provision = dag.get_task("provision")
    for field in ("accelerator_type", "runtime_version"):  # from plan: single_host_slice
        value = getattr(provision, field)
        assert (value.operator.task_id, value.key) == ("plan", field)


def test_slice_and_run_names():
    from rlax_tasks.airflow.params import dag_run_run_id
    from rlax_tasks.compute.types import slice_name

    assert slice_name("manual__2025-01-01t00-00-00-00-00", "worker") == (
        "rlax-manual-2025-01-01t00-00-00-00-00-worker"
    )
    name = slice_name("x" * 80, "controller")
    assert len(name) <= 63 and name.endswith("-controller")
    assert dag_run_run_id("manual__2025-01-01T00:00:00+00:00") == (
        "manual__2025-01-01t00-00-00-00-00"
    )
