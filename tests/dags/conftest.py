"""The DAG tests' paths; Airflow's environment is set up in tests/conftest.py (it must precede
the first import of airflow anywhere in the session)."""

from __future__ import annotations

import importlib
import json
import threading
import time
from collections.abc import Callable

import pytest

from rlax_tasks.rundir import storage
from rlax_tasks.rundir.storage import read_jsonl
from tests.conftest import DAGS, PLUGINS, REPO

__all__ = ["DAGS", "PLUGINS", "REPO", "read_jsonl"]


@pytest.fixture
def airflow_db():
    """A fresh Airflow metadata database for a `dag.test()` run."""
    from airflow.utils import db

    db.resetdb()
    yield


# the rlax_train drills' run: a 2-host trainer (2 forced CPU devices per host: a 1 x 4 mesh) and
# one worker on a slice of its own, 4 prompts of 4 samples a step, a checkpoint every step
DRILL_OVERRIDES = {
    "placement.mode": "disaggregated",
    "trainer.hosts": 2,
    "placement.trainer": [0, 1],
    "trainer.checkpoint_every": 1,
    "rollout.prompts_per_step": 4,
    "rollout.group_size": 4,
    "workers.slots": 16,
    "eval.num_prompts": 8,
    "eval.num_samples": 2,
    "eval.ks": [1, 2],
}


def drill_conf(
    tmp_path, run_id: str, steps: int, accelerator_type: str, worker_accelerator_type: str
) -> dict:
    """rlax_train's run conf for a drill: the DRILL_OVERRIDES run of ``steps`` steps on a tiny
    char model (written under ``tmp_path``), run root ``tmp_path/runs``, the trainer on a slice
    of ``accelerator_type`` and one worker slice of ``worker_accelerator_type``."""
    from tests.tiny_model import save_char_model

    model = str(tmp_path / "model")
    save_char_model(model)
    return {
        "run_root": str(tmp_path / "runs"),
        "run_id": run_id,
        "steps": steps,
        "model_path": model,
        "accelerator_type": accelerator_type,
        "worker_accelerator_type": worker_accelerator_type,
        "worker_slices": 1,
        "overrides": DRILL_OVERRIDES,
    }


def drill_dag(monkeypatch, tmp_path, connection: dict):
    """The rlax_train DAG as a task runs it with ``connection`` as its compute Connection (the
    environment's RLAX_BACKEND / RLAX_BACKEND_SETTINGS are only the fallback without one),
    retries after 1 s, slices and jobs checked every second, devices from placement only."""
    from airflow.dag_processing.dagbag import DagBag

    from rlax_tasks.airflow import factories
    from tests.conftest import TEST_XLA_FLAGS

    monkeypatch.delenv("RLAX_BACKEND", raising=False)
    monkeypatch.delenv("RLAX_BACKEND_SETTINGS", raising=False)
    monkeypatch.setenv("AIRFLOW_CONN_RLAX_COMPUTE", json.dumps(connection))
    monkeypatch.setenv("RLAX_RETRY_DELAY_S", "1")
    monkeypatch.setenv("RLAX_SIBLING_GRACE_S", "10")
    monkeypatch.setenv("RLAX_POLL_INTERVAL_S", "1")
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)
    monkeypatch.chdir(tmp_path)
    importlib.reload(factories)  # re-read the settings above (DEFAULT_ARGS' retry delay)
    return DagBag(dag_folder=DAGS).dags["rlax_train"]


def when_trained(run_dir: str, step: int, action: Callable[[int], None]) -> threading.Thread:
    """A started thread that calls ``action(step)`` once the run has trained ``step`` steps:
    metrics.jsonl says so, or the checkpoint of ``step`` is complete (the trainer's own record:
    on GCS, metrics.jsonl is written only every few seconds); join it after the run."""
    from rlax_tasks.trainer.checkpointing import is_complete_checkpoint

    checkpoint = storage.join(run_dir, "checkpoints", str(step))

    def trained() -> bool:
        steps = [r["step"] for r in read_jsonl(storage.join(run_dir, "metrics.jsonl"))]
        return (bool(steps) and max(steps) >= step) or is_complete_checkpoint(checkpoint)

    def watch() -> None:
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            if trained():
                action(step)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread
