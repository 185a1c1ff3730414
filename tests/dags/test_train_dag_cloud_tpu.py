"""`dag.test()` of rlax_train on the cloud_tpu backend against the fake Cloud TPU API: a 2-host
trainer slice (v4-16: the trainer as one jax.distributed group over both hosts, the PS and the
controller beside host 0) and one worker slice (v4-8), every host running the real
infra/tpu/startup.sh through the docker stand-in and real `rlax` jobs; the trainer slice is
preempted mid-run (spot reclaim), re-provisioned by the jobs' retries, and the run resumes: every
step applied once, the services found again at their new addresses, the worker's weights pulled
over TCP (its slice is another VM)."""

from __future__ import annotations

import json
import os

import pytest

from tests.compute.helpers import fake_backend_settings, fake_cloud_tpu, fake_state, preempt
from tests.dags.conftest import drill_conf, drill_dag, read_jsonl, when_trained

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


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rlax_train_on_cloud_tpu_slices_survives_a_preemption(tmp_path, monkeypatch, airflow_db):
    from airflow.utils.state import DagRunState

    # the trainer over a 2-host v4-16, the worker on a 1-host v4-8
    conf = drill_conf(tmp_path, RUN_ID, STEPS, "v4-16", "v4-8")
    run_root = conf["run_root"]
    run_dir = os.path.join(run_root, RUN_ID)
    with fake_cloud_tpu(str(tmp_path / "fake")) as url:
        settings = fake_backend_settings(url)  # run_root: the run's, added by dag_support
        # the run_root Param, not the environment the DAG file was parsed in, places the run
        # and its slices' control directories
        elsewhere = tmp_path / "parse-time-root"
        monkeypatch.setenv("RLAX_RUN_ROOT", str(elsewhere))
        # the backend and its settings come from a Google Cloud Connection
        connection = {"conn_type": "google_cloud_platform", "extra": settings}
        dag = drill_dag(monkeypatch, tmp_path, connection)
        seen: dict = {}

        def preempt_trainer_slice(step: int) -> None:
            seen["ps_before"] = _published(run_dir, "ps")
            seen["trainer_before"] = _published(run_dir, "trainer")
            seen["step"] = step
            preempt(url, TRAINER_SLICE)

        preempter = when_trained(run_dir, 2, preempt_trainer_slice)
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
    # the worker's slice is another VM than the PS's: it pulls the weights over TCP, never
    # through the PS's shared memory, though the fake's hosts share this machine's kernel
    pulls = [
        line
        for root, _, names in os.walk(run_root)
        for name in names
        if name == "stderr.log" and "worker-0." in root
        for line in open(os.path.join(root, name))
        if "pulling weights from" in line
    ]
    assert pulls and all(line.rstrip().endswith(" by TCP") for line in pulls), pulls
    assert any("process 1 of 2" in text for text in logs), slice_root
    # the final evaluation and the recorded state; the slices are gone
    assert os.path.exists(os.path.join(run_dir, "eval", f"v{STEPS}", "results.json"))
    with open(os.path.join(run_dir, "status.json")) as f:
        assert json.load(f)["state"] == "succeeded"
    assert not elsewhere.exists(), sorted(str(p) for p in elsewhere.rglob("*"))[:10]
    live = {n.rsplit("/", 1)[-1] for n, pids in state.get("agents", {}).items() if pids}
    assert not live & {TRAINER_SLICE, WORKER_SLICE}, state.get("agents")
