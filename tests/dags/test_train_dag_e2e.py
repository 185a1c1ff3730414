"""`dag.test()` of rlax_train end to end: the local backend on the tiny preset (a colocated
run: one `rlax colocated` job, watched by the controller task), a real process killed with
SIGKILL mid-run, detected and resumed by Airflow's retry. The separate jobs of a disaggregated
run are driven end to end in tests/dags/test_train_dag_cloud_tpu.py."""

from __future__ import annotations

import importlib
import json
import os
import signal
import threading
import time

import psutil
import pytest

from tests.dags.conftest import DAGS

STEPS = 8  # enough steps after the first that the kill lands mid-run at ~0.2 s a step


def _read_jsonl(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _job_child(status_dir: str) -> psutil.Process | None:
    """The `rlax` process a job runner started (the runner records itself in runner.json)."""
    try:
        with open(os.path.join(status_dir, "runner.json")) as f:
            runner = psutil.Process(json.load(f)["pid"])
        children = runner.children()
    except (FileNotFoundError, ValueError, psutil.Error):
        return None
    return children[0] if children else None


def _kill_when_training(run_dir: str, jobs_dir: str, name: str, killed: list) -> None:
    """SIGKILLs job ``name`` once the run has applied its first step (bounded wait)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not killed:
        if _read_jsonl(os.path.join(run_dir, "metrics.jsonl")):
            child = _job_child(os.path.join(jobs_dir, name))
            if child is not None:
                child.send_signal(signal.SIGKILL)
                killed.append((name, child.pid))
                return
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_rlax_train_end_to_end_with_a_killed_job(tmp_path, monkeypatch, airflow_db):
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils.state import DagRunState, TaskInstanceState

    from rlax_tasks.airflow import dag_support
    from tests.tiny_model import save_char_model

    run_root = str(tmp_path / "runs")
    monkeypatch.setenv("RLAX_RUN_ROOT", run_root)
    monkeypatch.setenv("RLAX_RETRY_DELAY_S", "1")
    monkeypatch.setenv("RLAX_SIBLING_GRACE_S", "20")
    monkeypatch.setenv("XLA_FLAGS", "")  # the jobs run on one device each
    monkeypatch.chdir(tmp_path)
    importlib.reload(dag_support)  # re-read the settings above (retry delay, run root)
    dag = DagBag(dag_folder=DAGS).dags["rlax_train"]
    model = str(tmp_path / "model")
    save_char_model(model)

    run_id = "dagtest"
    run_dir = os.path.join(run_root, run_id)
    jobs_dir = os.path.join(run_dir, "slices", "rlax-dagtest-trainer", "jobs")
    killed: list = []
    killer = threading.Thread(
        target=_kill_when_training, args=(run_dir, jobs_dir, "controller", killed), daemon=True
    )
    killer.start()
    conf = {
        "run_id": run_id,
        "steps": STEPS,
        "model_path": model,
        "overrides": {
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 4,
            "workers.slots": 16,
            "eval.num_prompts": 16,
            "eval.num_samples": 4,
            "eval.ks": [1, 4],
        },
    }
    dr = dag.test(run_conf=conf)
    killer.join(timeout=5)

    tis = {(ti.task_id, ti.map_index): ti for ti in dr.get_task_instances()}
    states = {f"{k[0]}[{k[1]}]": ti.state for k, ti in tis.items()}
    assert dr.state == DagRunState.SUCCESS, states
    assert killed and killed[0][0] == "controller", "the colocated job was never killed"
    # the kill was detected and the controller's task retried (restarting the job)
    assert tis[("controller", -1)].try_number >= 2, states
    # one job: the ps, trainer and worker tasks have none and are skipped
    skipped = {"ps[-1]", "trainer[-1]", "worker[-1]"}
    assert {k for k, v in states.items() if v == TaskInstanceState.SKIPPED} == skipped, states
    assert all(s == TaskInstanceState.SUCCESS for k, s in states.items() if k not in skipped)
    # the job ran twice: the killed attempt is archived next to the new one, which restored
    assert os.path.isdir(jobs_dir + "/controller.1")
    assert sorted(os.listdir(jobs_dir)) == ["controller", "controller.1", "evaluate"]
    # every step applied once, in order, across the kill
    lineage = _read_jsonl(os.path.join(run_dir, "lineage.jsonl"))
    assert [r["step"] for r in lineage] == list(range(1, STEPS + 1))
    consumed = [p for r in lineage for p in r["prompt_ids"]]
    assert len(consumed) == len(set(consumed)) == STEPS * 4
    # the evaluation of the final weights and the recorded final state
    with open(os.path.join(run_dir, "eval", f"v{STEPS}", "results.json")) as f:
        results = json.load(f)
    overall = results["models"][0]["overall"]
    assert overall["prompts"] == 16 and 0.0 <= overall["pass@1"] <= overall["pass@4"] <= 1.0
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f)["state"] == "succeeded"
    # every job of the run has ended (teardown), nothing is left running
    for name in os.listdir(jobs_dir):
        assert _job_child(os.path.join(jobs_dir, name)) is None, name
