"""`dag.test()` of rlax_train on the cloud_tpu backend against the fake Cloud TPU API: a 2-host
trainer slice (v4-16: the trainer as one jax.distributed group over both hosts, the PS and the
controller beside host 0) and one worker slice (v4-8), every host running the real
infra/tpu/startup.sh through the docker stand-in and real `rlax` jobs, with the run root and the
model on the GCS emulator and placement.platform tpu (each accelerator job in its VM's TPU
runtime: the fake libtpu's checks, then its chips as JAX's TPU devices, computing on the CPU; each
job checks that it found the TPU devices its placement names). The trainer slice is preempted
mid-run (spot reclaim), re-provisioned by the jobs' retries, and the run resumes: every step
applied once, the services found again at their new addresses, the worker's weights pulled over
TCP (its slice is another VM), the evaluations on the worker slice."""

from __future__ import annotations

import json
import os

import pytest

from rlax_tasks.rundir import storage
from tests.compute.helpers import fake_backend_settings, fake_cloud_tpu, fake_state, preempt
from tests.dags.conftest import drill_conf, drill_dag, read_jsonl, when_trained
from tests.paramserver.helpers import gcs_emulator

STEPS = 4
RUN_ID = "tpurun"
TRAINER_SLICE = "rlax-tpurun-trainer"
WORKER_SLICE = "rlax-tpurun-workers-0"


def _published(run_dir: str, job: str) -> str | None:
    try:
        return json.loads(storage.read_bytes(storage.join(run_dir, "services", f"{job}.json")))[
            "url"
        ]
    except (FileNotFoundError, ValueError):
        return None


def _upload(local_dir: str, gcs_dir: str) -> str:
    for name in os.listdir(local_dir):
        with open(os.path.join(local_dir, name), "rb") as f:
            storage.write_bytes(storage.join(gcs_dir, name), f.read())
    return gcs_dir


def _job_logs(run_dir: str, job: str) -> dict[str, str]:
    """{path: stderr} of every host's attempt of ``job`` on the run's slices."""
    return {
        path: storage.read_bytes(path).decode()
        for path in storage.list_prefix(storage.join(run_dir, "slices"))
        if path.endswith("/stderr.log") and f"/{job}." in path
    }


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_rlax_train_on_cloud_tpu_slices_survives_a_preemption(tmp_path, monkeypatch, airflow_db):
    from airflow.utils.state import DagRunState

    # the trainer over a 2-host v4-16, the worker on a 1-host v4-8
    conf = drill_conf(tmp_path, RUN_ID, STEPS, "v4-16", "v4-8")
    # the TPU placement: each accelerator job checks that JAX found the TPU and the chips its
    # placement names (the fake libtpu's, computing on the CPU), the ps and controller cpu
    conf["overrides"] = {
        **conf["overrides"],
        "placement.platform": "tpu",
        "placement.trainer": [0, 1, 2, 3],
    }
    with gcs_emulator("rlax-drill") as bucket, fake_cloud_tpu(str(tmp_path / "fake")) as url:
        # the run root and the model on GCS: the slices' hosts share no file system with Airflow
        # or each other
        run_root = conf["run_root"] = f"{bucket}/runs"
        conf["model_path"] = _upload(conf["model_path"], f"{bucket}/models/char")
        run_dir = storage.join(run_root, RUN_ID)
        settings = fake_backend_settings(url)  # run_root: the run's, added by factories
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
        # what the run left on GCS, read before the emulator stops
        lineage = read_jsonl(storage.join(run_dir, "lineage.jsonl"))
        published = {job: _published(run_dir, job) for job in ("ps", "trainer")}
        trainer_logs = _job_logs(run_dir, "trainer")
        worker_logs = _job_logs(run_dir, "worker-0")
        evaluation_logs = {**_job_logs(run_dir, "evaluate-base"), **_job_logs(run_dir, "evaluate")}
        evaluated = storage.exists(storage.join(run_dir, "eval", f"v{STEPS}", "results.json"))
        status = json.loads(storage.read_bytes(storage.join(run_dir, "status.json")))

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
    assert [r["step"] for r in lineage] == list(range(1, STEPS + 1))
    consumed = [p for r in lineage for p in r["prompt_ids"]]
    assert len(consumed) == len(set(consumed)) == STEPS * 4
    # a re-created TPU VM has a new address: the clients found the services there
    assert seen["ps_before"] and published["ps"] != seen["ps_before"]
    assert published["trainer"] != seen["trainer_before"]
    # the trainer was one group over both hosts of its slice, on each VM of its slice (the
    # preempted one's logs were on GCS before it went)
    slices = {path.split("/slices/")[1].split("/")[1] for path in trainer_logs}
    assert len(slices) == 2, sorted(trainer_logs)
    for text in ("process 0 of 2", "process 1 of 2"):
        assert any(text in log for log in trainer_logs.values()), sorted(trainer_logs)
    # ... each host's process in the slice-wide TPU runtime of its VM, given the host's 4 chips
    # (what placement.trainer names: the job's device check passed), one mesh over the 8
    for host in (0, 1):
        joined = f"fake libtpu: host {host} of v4-16: the slice's 2 hosts joined; 4 TPU device(s)"
        assert sum(joined in log for log in trainer_logs.values()) == 2, sorted(trainer_logs)
    for log in trainer_logs.values():
        assert "4 of 8 devices here" in log and "'fsdp': 8" in log
    # the evaluations ran on the worker slice, every chip of its one host, not on one host of
    # the trainer's
    assert sorted(path.split("/slices/")[1].split("/")[0] for path in evaluation_logs) == [
        WORKER_SLICE,
        WORKER_SLICE,
    ], sorted(evaluation_logs)
    for log in [*evaluation_logs.values(), *worker_logs.values()]:
        assert "fake libtpu: v4-8: every chip of its one host; 4 TPU device(s)" in log
    # the worker took every chip of its host (a trainer over several TPU hosts leaves it none)
    assert all(
        "worker mesh {'data': 1, 'fsdp': 1, 'expert': 1, 'tensor': 4}" in log
        for log in worker_logs.values()
    )
    # the worker's slice is another VM than the PS's: it pulls the weights over TCP, never
    # through the PS's shared memory, though the fake's hosts share this machine's kernel
    pulls = [
        line
        for text in worker_logs.values()
        for line in text.splitlines()
        if "pulling weights from" in line
    ]
    assert pulls and all(line.rstrip().endswith(" by TCP") for line in pulls), pulls
    # the final evaluation and the recorded state; the slices are gone
    assert evaluated
    assert status["state"] == "succeeded"
    assert not elsewhere.exists(), sorted(str(p) for p in elsewhere.rglob("*"))[:10]
    live = {n.rsplit("/", 1)[-1] for n, pids in state.get("agents", {}).items() if pids}
    assert not live & {TRAINER_SLICE, WORKER_SLICE}, state.get("agents")
