"""The triggerer imports the trigger module: it must stay light (no JAX, no cloud client, no
operator module) and every trigger must round-trip through serialize()."""

import subprocess
import sys

from rlax_tasks.airflow import JobStateTrigger, SliceReadyTrigger


def test_trigger_module_imports_no_heavy_modules():
    code = (
        "import sys, rlax_tasks.airflow.triggers; "
        "heavy = [m for m in ('jax', 'google.cloud.tpu_v2', 'rlax_tasks.airflow.operators', "
        "'rlax_tasks.models') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"  # Airflow may log lines before it


def test_triggers_serialize_to_their_own_class_path():
    job = JobStateTrigger("local", {"run_root": "/r"}, {"name": "j"}, poll_interval_s=3)
    path, kwargs = job.serialize()
    assert path == "rlax_tasks.airflow.triggers.JobStateTrigger"
    assert JobStateTrigger(**kwargs).serialize() == (path, kwargs)
    ready = SliceReadyTrigger("cloud_tpu", {"run_root": "gs://b"}, {"name": "s"})
    path, kwargs = ready.serialize()
    assert path == "rlax_tasks.airflow.triggers.SliceReadyTrigger"
    assert SliceReadyTrigger(**kwargs).serialize() == (path, kwargs)
