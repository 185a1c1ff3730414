"""`dag.test()` of rlax_train on the cloud_tpu backend against the fake Cloud TPU API: a 2-host
trainer slice (v4-16: the trainer as one jax.distributed group over both hosts, the PS and the
controller beside host 0) and one worker slice (v4-8), every host running the real
infra/tpu/startup.sh through the docker stand-in and real `rlax` jobs; the trainer slice is
preempted mid-run (spot reclaim), re-provisioned by the jobs' retries, and the run resumes: every
step applied once, the services found again at their new addresses."""

from __future__ import annotations

import importlib
import json
import os
import threading
import time

import pytest

from rlax_tasks.rundir import storage
from tests.compute.helpers import fake_backend_settings, fake_cloud_tpu, fake_state, preempt
from tests.conftest import TEST_XLA_FLAGS
from tests.dags.conftest import DAGS, read_jsonl

STEPS = 4
RUN_ID = "tpurun"
TRAINER_SLICE = "rlax-tpurun-trainer"
WORKER_SLICE = "rlax-tpurun-workers-0"


def _published(run_dir: str, job: str) -> str | None:
    try:
        with open(os.path.join(run_dir, "services", f"{job}.json")) as f:
            return json.load(f)["url"]
    except (FileNotFoundError, ValueError):
        return None


def _preempt_when_training(url: str, run_dir: str, seen: dict) -> None:
    """Preempts the trainer slice once the run applied 2 steps, noting where the PS was."""
    deadline = time.monotonic() + 1200
    while time.monotonic() < deadline:
        steps = [r["step"] for r in storage.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))]
        if steps and max(steps) >= 2:
            seen["ps_before"] = _published(run_dir, "ps")
            seen["trainer_before"] = _published(run_dir, "trainer")
            seen["step"] = max(steps)
            preempt(url, TRAINER_SLICE)
            return
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rlax_train_on_cloud_tpu_slices_survives_a_preemption(tmp_path, monkeypatch, airflow_db):
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils.state import DagRunState

    from rlax_tasks.airflow import dag_support
    from tests.tiny_model import save_char_model

    run_root = str(tmp_path / "runs")
    run_dir = os.path.join(run_root, RUN_ID)
    model = str(tmp_path / "model")
    save_char_model(model)
    with fake_cloud_tpu(str(tmp_path / "fake")) as url:
        settings = fake_backend_settings(url)  # run_root: the run's, added by dag_support
        # the backend and its settings come from a Google Cloud Connection (the environment's
        # RLAX_BACKEND / RLAX_BACKEND_SETTINGS are only the fallback without one)
        monkeypatch.delenv("RLAX_BACKEND", raising=False)
        monkeypatch.delenv("RLAX_BACKEND_SETTINGS", raising=False)
        connection = {"conn_type": "google_cloud_platform", "extra": settings}
        monkeypatch.setenv("AIRFLOW_CONN_RLAX_COMPUTE", json.dumps(connection))
        # the run_root Param, not the environment the DAG file was parsed in, places the run
        # and its slices' control directories
        elsewhere = tmp_path / "parse-time-root"
        monkeypatch.setenv("RLAX_RUN_ROOT", str(elsewhere))
        monkeypatch.setenv("RLAX_RETRY_DELAY_S", "1")
        monkeypatch.setenv("RLAX_SIBLING_GRACE_S", "10")
        monkeypatch.setenv("RLAX_POLL_INTERVAL_S", "1")  # slices and jobs checked every second
        monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)  # devices: from placement only
        monkeypatch.chdir(tmp_path)
        importlib.reload(dag_support)  # re-read the settings above
        dag = DagBag(dag_folder=DAGS).dags["rlax_train"]
        seen: dict = {}
        preempter = threading.Thread(
            target=_preempt_when_training, args=(url, run_dir, seen), daemon=True
        )
        preempter.start()
        conf = {
            "run_root": run_root,
            "run_id": RUN_ID,
            "steps": STEPS,
            "model_path": model,
            "accelerator_type": "v4-16",  # 2 hosts
            "worker_accelerator_type": "v4-8",  # 1 host: 1 worker
            "worker_slices": 1,
            "overrides": {
                "placement.mode": "disaggregated",  # separate jobs on two kinds of slice
                "trainer.hosts": 2,
                "placement.trainer": [0, 1],  # 2 forced CPU devices per host: a 1 x 4 mesh
                "trainer.checkpoint_every": 1,
                "rollout.prompts_per_step": 4,
                "rollout.group_size": 4,
                "workers.slots": 16,
                "eval.num_prompts": 8,
                "eval.num_samples": 2,
                "eval.ks": [1, 2],
            },
        }
        dr = dag.test(run_conf=conf)
        preempter.join(timeout=5)
        state = fake_state(url)

    tis = {(ti.task_id, ti.map_index): ti for ti in dr.get_task_instances()}
    states = {f"{k[0]}[{k[1]}]": ti.state for k, ti in tis.items()}
    assert dr.state == DagRunState.SUCCESS, states
    assert seen.get("step"), "the trainer slice was never preempted"
    # the trainer slice's jobs were retried onto the re-provisioned slice
    assert tis[("trainer", -1)].try_number >= 2, states
    assert tis[("ps", -1)].try_number >= 2, states
    # the worker ran on a slice of its own and was not restarted
    assert tis[("worker", 0)].try_number == 1, states
    # every step applied once, in order, across the preemption
    lineage = read_jsonl(os.path.join(run_dir, "lineage.jsonl"))
    assert [r["step"] for r in lineage] == list(range(1, STEPS + 1))
    consumed = [p for r in lineage for p in r["prompt_ids"]]
    assert len(consumed) == len(set(consumed)) == STEPS * 4
    # a re-created TPU VM has a new address: the clients found the services there
    assert seen["ps_before"] and _published(run_dir, "ps") != seen["ps_before"]
    assert _published(run_dir, "trainer") != seen["trainer_before"]
    # the trainer was one group over both hosts of its slice
    slice_root = os.path.join(run_root, "slices", TRAINER_SLICE)
    logs = [
        open(os.path.join(root, name)).read()
        for root, _, names in os.walk(run_root)
        for name in names
        if name == "stderr.log" and "trainer" in root
    ]
    assert any("process 0 of 2" in text for text in logs), slice_root
    assert any("process 1 of 2" in text for text in logs), slice_root
    # the final evaluation and the recorded state; the slices are gone
    assert os.path.exists(os.path.join(run_dir, "eval", f"v{STEPS}", "results.json"))
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f)["state"] == "succeeded"
    assert not elsewhere.exists(), sorted(str(p) for p in elsewhere.rglob("*"))[:10]
    live = {n.rsplit("/", 1)[-1] for n, pids in state.get("agents", {}).items() if pids}
    assert not live & {TRAINER_SLICE, WORKER_SLICE}, state.get("agents")
