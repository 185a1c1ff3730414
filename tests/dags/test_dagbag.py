"""Every DAG under dags/ imports cleanly, with owners, tags, retries, docs and validated Params."""

from __future__ import annotations

import copy

import pytest

from tests.dags.conftest import DAGS

EXPECTED = {"rlax_train", "rlax_nightly_eval", "rlax_curate", "rlax_janitor"}


@pytest.fixture(scope="module")
def dagbag():
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=DAGS)


def test_all_dags_import_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert EXPECTED <= set(dagbag.dag_ids)


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
    assert resolved["preset"] == "tiny-arith" and resolved["num_workers"] >= 1
    bad_values = {
        "preset": "no-such-preset",
        "algorithm": "sgd",
        "reload_every": 0,
        "max_staleness": 0,
        "num_workers": 0,
        "steps": -1,
        "run_id": "Bad/Id",
    }
    for key, value in bad_values.items():
        params = copy.deepcopy(dag.params)
        with pytest.raises(Exception) as err:  # noqa: B017 - ParamValidationError / ValueError
            params[key] = value
            params.validate()
        assert key in str(err.value) or "Invalid input" in str(err.value) or value is not None
    ok = copy.deepcopy(dag.params)
    ok["algorithm"] = "dapo"
    ok["max_staleness"] = None
    assert ok.validate()["algorithm"] == "dapo"


def test_algorithm_choices_match_the_objective_presets():
    import rlax_common
    from rlax_tasks.algorithms.config import PRESETS

    assert set(rlax_common.ALGORITHMS) == set(PRESETS)


def test_data_format_choices_match_the_dataset_formats():
    import rlax_common
    from rlax_tasks.data.formats import FORMAT_NAMES

    assert rlax_common.DATA_FORMATS == FORMAT_NAMES


def test_train_graph_shape(dagbag):
    dag = dagbag.dags["rlax_train"]
    ids = set(dag.task_ids)
    assert {"plan", "provision", "ps", "trainer", "worker", "controller", "finish", "evaluate",
            "teardown", "record_state"} <= ids  # fmt: skip
    teardown = dag.get_task("teardown")
    assert teardown.is_teardown and teardown.trigger_rule == "all_done_setup_success"
    assert dag.get_task("provision").is_setup
    assert "teardown" in dag.get_task("controller").get_flat_relative_ids(upstream=False)
    assert dag.get_task("plan").retries == 0  # configuration errors never retry


def test_rlax_common_names():
    import rlax_common as rc

    assert rc.slice_name("manual__2025-01-01t00-00-00-00-00", "worker") == (
        "rlax-manual-2025-01-01t00-00-00-00-00-worker"
    )
    name = rc.slice_name("x" * 80, "controller")
    assert len(name) <= 63 and name.endswith("-controller")
    assert rc.dag_run_run_id("manual__2025-01-01T00:00:00+00:00") == (
        "manual__2025-01-01t00-00-00-00-00"
    )
