"""The triggerer imports the trigger module and the scheduler parses the DAG files (which import
factories, params and plan_task): both must stay light (no JAX, no cloud client, no run config;
the triggerer no operator module), and every trigger must round-trip through serialize()."""

import inspect
import json
import subprocess
import sys

import pytest

from rlax_tasks.airflow import JobStateTrigger, SliceReadyTrigger


def _loaded_by(module: str, candidates: tuple[str, ...]) -> list[str]:
    """Which of ``candidates`` a fresh interpreter has loaded after ``import module``."""
    code = (
        f"import json, sys, {module}; "
        f"print(json.dumps([m for m in {list(candidates)!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # Airflow may log lines before it


def test_trigger_module_imports_no_heavy_modules():
    heavy = ("jax", "google.cloud.tpu_v2", "rlax_tasks.airflow.operators", "rlax_tasks.models")
    assert _loaded_by("rlax_tasks.airflow.triggers", heavy) == []


@pytest.mark.parametrize(
    "module",
    [
        "rlax_tasks.airflow.factories",
        "rlax_tasks.airflow.params",
        "rlax_tasks.airflow.plan_task",
        "rlax_tasks.airflow.eval_planning",
        "rlax_tasks.airflow.janitor",
        "rlax_tasks.airflow.run_status",
        "rlax_tasks.plan.slices",
    ],
)
def test_modules_the_dag_files_import_load_no_heavy_modules(module):
    heavy = ("jax", "flax", "rlax_tasks.config", "google.cloud.tpu_v2", "rlax_tasks.models")
    assert _loaded_by(module, heavy) == []


def test_triggers_serialize_to_their_own_class_path():
    job = JobStateTrigger("local", {"run_root": "/r"}, {"name": "j"}, poll_interval_s=3)
    path, kwargs = job.serialize()
    assert path == "rlax_tasks.airflow.triggers.JobStateTrigger"
    assert JobStateTrigger(**kwargs).serialize() == (path, kwargs)
    ready = SliceReadyTrigger("cloud_tpu", {"run_root": "gs://b"}, {"name": "s"})
    path, kwargs = ready.serialize()
    assert path == "rlax_tasks.airflow.triggers.SliceReadyTrigger"
    assert SliceReadyTrigger(**kwargs).serialize() == (path, kwargs)


def test_every_trigger_setting_survives_the_triggerer():
    """The base trigger's serialize() gives back every constructor setting, JSON-encodable (the
    triggerer rebuilds the trigger from it); each trigger keeps its own default poll interval."""
    job = JobStateTrigger(
        "local", {"run_root": "/r"}, {"name": "j"}, poll_interval_s=3, max_consecutive_errors=2,
        done_when={"name": "c"}, siblings=[{"name": "s"}], sibling_grace_s=9, done_marker="/r/d",
    )  # fmt: skip
    path, kwargs = job.serialize()
    assert set(kwargs) == set(inspect.signature(JobStateTrigger).parameters)
    again = JobStateTrigger(**json.loads(json.dumps(kwargs)))
    assert again.serialize() == (path, kwargs)
    got = (again.poll_interval_s, again.max_consecutive_errors, again.siblings, again.done_marker)
    assert got == (3.0, 2, [{"name": "s"}], "/r/d")
    ready = SliceReadyTrigger("local", None, {"name": "s"}, max_consecutive_errors=4)
    assert set(ready.serialize()[1]) == set(inspect.signature(SliceReadyTrigger).parameters)
    assert (ready.poll_interval_s, ready.max_consecutive_errors) == (15.0, 4)
    assert JobStateTrigger("local", None, {"name": "j"}).poll_interval_s == 10.0
