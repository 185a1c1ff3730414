"""rlax_train's plan task: the slice checks (``rlax_tasks.plan.slices``) it runs before anything
is provisioned, the runtime version it provisions with, the Params it maps onto the run
config, and the TrainingPlan it hands the DAG's tasks (its XCom)."""

from __future__ import annotations

import json
import os

import pytest

from rlax_tasks.airflow import eval_planning
from rlax_tasks.airflow import factories as rc
from rlax_tasks.airflow.plan_task import plan_training
from rlax_tasks.compute import tpu_types
from rlax_tasks.plan import slices
from rlax_tasks.plan.run_plan import TrainingPlan
from rlax_tasks.plan.slices import PlanError
from rlax_tasks.plan.topology import WorkerSlices


def _refusal(*args) -> str:
    with pytest.raises(PlanError) as info:
        slices.check_slice(*args)
    message = str(info.value)
    assert "\n" not in message  # one line, for the task log and the UI
    return message


@pytest.mark.parametrize(
    ("accelerator_type", "hosts", "runtime"),
    [
        ("v4-8", 1, "tpu-ubuntu2204-base"),
        ("v4-16", 2, "tpu-ubuntu2204-base"),
        ("v5p-8", 1, "v2-alpha-tpuv5"),
        ("v5litepod-8", 1, "v2-alpha-tpuv5-lite"),
        ("v6e-16", 4, "v2-alpha-tpuv6e"),
    ],
)
def test_cloud_tpu_defaults_the_runtime_of_the_accelerator_family(accelerator_type, hosts, runtime):
    assert slices.check_slice(accelerator_type, None, hosts, "cloud_tpu") == runtime
    assert runtime == tpu_types.default_runtime_version(accelerator_type)
    given = slices.check_slice(accelerator_type, "tpu-vm-v4-base.2", hosts, "cloud_tpu")
    assert given == "tpu-vm-v4-base.2"  # a given runtime version is used as is


@pytest.mark.parametrize("accelerator_type", ["cpu", "v9-8", "v4-7", "v5litepod-3", "", "V4-8"])
def test_cloud_tpu_refuses_types_it_cannot_provision(accelerator_type):
    with pytest.raises(tpu_types.UnknownAcceleratorError) as unknown:
        tpu_types.tpu_type(accelerator_type)
    message = _refusal(accelerator_type, None, 1, "cloud_tpu")
    assert message.startswith("accelerator_type: ")
    assert str(unknown.value) in message  # the table's own explanation (families, sizes)


@pytest.mark.parametrize("backend", ["cloud_tpu", "local"])
@pytest.mark.parametrize("runtime", ["", "V2-alpha", "-v2", "v2 alpha", "v2_alpha", "v2/x"])
def test_malformed_runtime_versions_are_refused(backend, runtime):
    accelerator_type = "v5litepod-8" if backend == "cloud_tpu" else "cpu"
    message = _refusal(accelerator_type, runtime, 1, backend)
    assert message.startswith(f"runtime_version: {runtime!r} ")


def test_trainer_hosts_must_match_the_hosts_of_the_type():
    assert _refusal("v4-16", None, 1, "cloud_tpu") == (
        "accelerator_type: v4-16 has 2 hosts but trainer.hosts is 1: set overrides "
        '{"trainer.hosts": 2} or pick a 1-host type (v4-8)'
    )
    assert _refusal("v4-8", None, 2, "cloud_tpu") == (
        "accelerator_type: v4-8 has 1 host but trainer.hosts is 2: set overrides "
        '{"trainer.hosts": 1} or pick a 2-host type (v4-16)'
    )
    assert _refusal("v5litepod-8", None, 4, "cloud_tpu").endswith(
        "or pick a 4-host type (v5litepod-16)"
    )
    # no v5e slice has 2 hosts (8 chips fit one): only the override is suggested
    assert _refusal("v5litepod-16", None, 2, "cloud_tpu").endswith(
        'set overrides {"trainer.hosts": 4}'
    )


def test_ray_slice_types_are_checked_against_trainer_hosts():
    assert slices.check_slice("2xcpu", None, 2, "ray") == ""
    assert slices.check_slice("8xgpu-8", None, 8, "ray") == ""
    assert slices.check_slice("v5litepod-16", None, 4, "ray") == ""  # a TPU type: 4 hosts
    assert _refusal("2xgpu-8", None, 4, "ray") == (
        "accelerator_type: 2xgpu-8 has 2 hosts but trainer.hosts is 4: set overrides "
        '{"trainer.hosts": 2} or pick a 4-host type (4xgpu-8)'
    )
    assert _refusal("cpu", None, 2, "ray").endswith("or pick a 2-host type (2xcpu)")
    assert _refusal("h100", None, 1, "ray").startswith(
        "accelerator_type: accelerator_type='h100' is not a Ray slice type: use cpu, gpu-G"
    )
    # worker slices: one worker per host of each
    assert slices.worker_slice_layout("2xgpu-4", 3, "ray") == WorkerSlices(3, 2)
    with pytest.raises(PlanError, match="^worker_accelerator_type: "):
        slices.worker_slice_layout("gpu", 1, "ray")


def test_local_backend_keeps_ignoring_the_accelerator_type():
    """As before the checks: the local backend runs every job on this machine whatever type is
    named, so neither the type nor trainer.hosts is checked, and no runtime is defaulted."""
    assert slices.check_slice("cpu", None, 1, "local") == ""
    assert slices.check_slice("v4-16", None, 1, "local") == ""
    assert slices.check_slice("not-a-tpu", None, 3, "local") == ""
    assert slices.check_slice("cpu", "v2-alpha-tpuv5", 1, "local") == "v2-alpha-tpuv5"


def tiny_params(tmp_path, run_id: str, steps: int = 2, **extra) -> dict:
    """rlax_train Params for the tiny preset on a tiny char model saved under tmp_path."""
    from tests.tiny_model import save_char_model

    save_char_model(str(tmp_path / "model"))
    return {
        "preset": "tiny-arith",
        "run_root": str(tmp_path / "runs"),
        "run_id": run_id,
        "steps": steps,
        "model_path": str(tmp_path / "model"),
        **extra,
    }


def test_the_plan_refuses_a_slice_before_writing_anything(tmp_path, monkeypatch):
    """plan_training runs the checks on the run config right after loading it: nothing of the
    run is written, no model built, nothing provisioned."""
    monkeypatch.setenv("RLAX_BACKEND", "cloud_tpu")
    params = {"preset": "tiny-arith", "run_root": str(tmp_path / "runs"), "steps": 2}
    with pytest.raises(PlanError, match="^accelerator_type: accelerator type 'cpu' is not"):
        plan_training({**params, "accelerator_type": "cpu"}, "manual__a")
    with pytest.raises(PlanError, match=r"^runtime_version: ''"):
        plan_training({**params, "accelerator_type": "v4-8", "runtime_version": ""}, "manual__b")
    with pytest.raises(PlanError, match=r"v4-16 has 2 hosts but trainer.hosts is 1"):
        plan_training({**params, "accelerator_type": "v4-16"}, "manual__c")
    assert not (tmp_path / "runs").exists()


def test_provision_passes_the_runtime_version_to_the_operator(monkeypatch):
    monkeypatch.setenv("RLAX_BACKEND", "cloud_tpu")
    op = rc.provision("provision", "gs://b/runs", "rlax-r1-main", "r1", "v4-8", "v2-alpha-x")
    assert (op.accelerator_type, op.runtime_version) == ("v4-8", "v2-alpha-x")
    # the backend is resolved when the task runs (compute Connection, else the environment)
    assert op.backend is None and op.backend_settings == {"run_root": "gs://b/runs"}
    assert op._resolved()[0] == "cloud_tpu"
    assert "runtime_version" in op.template_fields  # an XComArg from plan is resolved at runtime


def test_rlax_poll_interval_s_sets_how_often_slices_and_jobs_are_checked(monkeypatch):
    monkeypatch.delenv("RLAX_POLL_INTERVAL_S", raising=False)
    defaults = (rc.provision("p", "runs", "s", "r1", "cpu").poll_interval_s,
                rc.job("j", "runs", {}, ["ps"]).poll_interval_s)  # fmt: skip
    assert defaults == (15.0, 10.0)  # the operators' own
    monkeypatch.setenv("RLAX_POLL_INTERVAL_S", "1.5")
    assert rc.provision("p", "runs", "s", "r1", "cpu").poll_interval_s == 1.5
    assert rc.provision_slices("p", "runs", [], "r1").poll_interval_s == 1.5
    assert rc.job("j", "runs", {}, ["ps"]).poll_interval_s == 1.5
    assert rc.job("j", "runs", {}, ["ps"], poll_interval_s=3.0).poll_interval_s == 3.0


def test_a_run_plans_a_trainer_slice_and_its_worker_slices(tmp_path, monkeypatch):
    """cloud_tpu: the trainer slice over all its hosts, the worker slices one worker per host,
    each job placed on its slice and hosts; services publish their addresses under the run."""
    monkeypatch.setenv("RLAX_BACKEND", "cloud_tpu")
    # a local run root: only with the fake Cloud TPU API, whose hosts share this machine's disk
    monkeypatch.setenv("RLAX_BACKEND_SETTINGS", json.dumps({"api_endpoint": "http://127.0.0.1:1"}))
    params = tiny_params(
        tmp_path,
        "r1",
        accelerator_type="v4-16",
        worker_accelerator_type="v5litepod-8",
        worker_slices=2,
        overrides={"trainer.hosts": 2, "placement.mode": "disaggregated"},
    )
    p = plan_training(params, "manual__a")
    # the capacity, service_account, network and subnetwork Params' defaults
    spot = {"spot": True, "reserved": False, "service_account": "", "network": "", "subnetwork": ""}
    unmarked = {**spot, "evaluation": False}  # the evaluations run on the trainer slice
    assert [s.to_dict() for s in p.slices] == [
        {"role": "trainer", "name": "rlax-r1-trainer", "accelerator_type": "v4-16",
         "runtime_version": "tpu-ubuntu2204-base", **unmarked},
        {"role": "workers-0", "name": "rlax-r1-workers-0", "accelerator_type": "v5litepod-8",
         "runtime_version": "v2-alpha-tpuv5-lite", **unmarked},  # its own family's default
        {"role": "workers-1", "name": "rlax-r1-workers-1", "accelerator_type": "v5litepod-8",
         "runtime_version": "v2-alpha-tpuv5-lite", **unmarked},
    ]  # fmt: skip
    reserved = plan_training(
        {**params, "capacity": "reserved", "service_account": "rl@p.iam.gserviceaccount.com",
         "network": "rl-net", "subnetwork": "rl-subnet"}, "manual__e",
    ).to_dict()["slices"]  # fmt: skip
    expected = {
        **spot, "spot": False, "reserved": True, "network": "rl-net",
        "service_account": "rl@p.iam.gserviceaccount.com", "subnetwork": "rl-subnet",
    }  # fmt: skip
    assert all({k: s[k] for k in spot} == expected for s in reserved), reserved
    on_demand = plan_training({**params, "capacity": "on-demand"}, "manual__f").slices
    assert all(not s.spot and not s.reserved for s in on_demand)
    with pytest.raises(PlanError, match=r"^capacity: capacity 'preemptible' is not one of"):
        plan_training({**params, "capacity": "preemptible"}, "manual__g")
    with pytest.raises(PlanError, match=r"^service_account 'rl': give the service account"):
        plan_training({**params, "service_account": "rl"}, "manual__h")
    assert len(p.workers) == 2  # one per host of 2 one-host slices
    assert p.trainer.hosts == (0, 1)
    assert [(w.slice, w.hosts) for w in p.workers] == [("workers-0", (0,)), ("workers-1", (0,))]
    assert p.ps_url == str(tmp_path / "runs" / "r1" / "services" / "ps.json")
    handles = {s.role: {"name": s.name} for s in p.slices}
    jobs = rc.worker_jobs(p, handles)  # the mapped worker tasks' kwargs: each its job and slice
    assert [j["slice_handle"]["name"] for j in jobs] == ["rlax-r1-workers-0", "rlax-r1-workers-1"]
    assert [j["job"] for j in jobs] == [w.to_dict() for w in p.workers]

    with pytest.raises(PlanError, match="^num_workers: 3 workers, but 2 worker_slices"):
        plan_training({**params, "num_workers": 3}, "manual__b")
    monkeypatch.delenv("RLAX_BACKEND_SETTINGS")  # the real API: TPU VMs cannot read this disk
    with pytest.raises(PlanError, match=r"^run_root: '.*' is a path on this machine, which TPU"):
        plan_training({**params, "run_id": "r2"}, "manual__d")
    assert not (tmp_path / "runs" / "r2").exists()  # refused before anything was written
    with pytest.raises(PlanError, match="^worker_accelerator_type: accelerator type 'cpu'"):
        plan_training({**params, "worker_accelerator_type": "cpu"}, "manual__c")


def test_under_a_trainer_over_tpu_hosts_evaluation_runs_on_the_first_worker_slice(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("RLAX_BACKEND", "cloud_tpu")
    monkeypatch.setenv("RLAX_BACKEND_SETTINGS", json.dumps({"api_endpoint": "http://127.0.0.1:1"}))
    overrides = {
        "placement.mode": "disaggregated",
        "placement.platform": "tpu",
        "trainer.hosts": 2,
        "placement.trainer": [0, 1, 2, 3],
        "trainer.mesh_shape": [1, -1, 1],
        "workers.count": 2,
    }
    params = tiny_params(tmp_path, "r1", accelerator_type="v5p-16", overrides=overrides)
    with pytest.raises(PlanError, match="^worker_accelerator_type: a trainer over 2 TPU hosts"):
        plan_training(params, "manual__a")
    listed = {**overrides, "placement.workers": [[4], [5]]}
    with pytest.raises(
        PlanError, match="^run config: placement.workers: the workers run on hosts of their own"
    ):
        plan_training({**params, "overrides": listed, "worker_accelerator_type": "v5p-8",
                          "worker_slices": 2}, "manual__c")  # fmt: skip
    # a worker alone on a host of a 2-host TPU slice would wait for the other host
    with pytest.raises(
        PlanError,
        match=r"^worker_accelerator_type: a worker runs on one TPU "
        r"host.* \(e.g. v5p-8, v4-8\) with worker_slices: 2 for 2 workers$",
    ):
        plan_training({**params, "worker_accelerator_type": "v5p-16"}, "manual__d")
    assert not (tmp_path / "runs" / "r1").exists()
    p = plan_training(
        {**params, "worker_accelerator_type": "v5p-8", "worker_slices": 2}, "manual__b"
    )
    assert [s.role for s in p.slices if s.evaluation] == ["workers-0"]
    assert p.eval_env == p.workers[0].env != p.trainer.env
    assert not [k for k in p.trainer.env if k.startswith("TPU_")]  # libtpu: the whole slice


def test_workers_on_slices_of_their_own_take_every_chip_of_their_host(tmp_path, monkeypatch):
    """platform tpu, a one-host trainer slice and worker slices: the workers' chips are another
    VM's, not the trainer's (no device lists for them, none refused as shared), and a trainer
    of one chip is not made colocated with a sampler the worker slices would never run."""
    from rlax_tasks.process.device_check import EXPECTED_ENV

    monkeypatch.setenv("RLAX_BACKEND", "cloud_tpu")
    monkeypatch.setenv("RLAX_BACKEND_SETTINGS", json.dumps({"api_endpoint": "http://127.0.0.1:1"}))
    overrides = {
        "placement.mode": None,  # the default: disaggregated, whatever the trainer's chips
        "placement.platform": "tpu",
        "placement.trainer": [0, 1, 2, 3],
    }
    params = tiny_params(
        tmp_path, "r1", accelerator_type="v4-8", worker_accelerator_type="v4-8",
        worker_slices=2, overrides=overrides,
    )  # fmt: skip
    p = plan_training(params, "manual__a")
    assert [w.slice for w in p.workers] == ["workers-0", "workers-1"]
    for worker in p.workers:  # libtpu gives the process every chip of its VM
        env = worker.env
        assert env[EXPECTED_ENV] == "tpu any" and not [k for k in env if k.startswith("TPU_")]
    assert p.trainer.env[EXPECTED_ENV] == "tpu 4"
    one_chip = {**overrides, "placement.trainer": [0]}
    p = plan_training(
        {**params, "run_id": "r2", "worker_slices": 1, "overrides": one_chip}, "manual__b"
    )
    assert [j.name for j in p.jobs()] == [
        "ps",
        "trainer",
        "worker-0",
        "controller",
    ]  # disaggregated
    listed = {**overrides, "placement.workers": [[0, 1, 2, 3]]}
    with pytest.raises(PlanError, match="^run config: placement.workers: the workers run on"):
        plan_training({**params, "run_id": "r3", "overrides": listed}, "manual__c")
    colocated = {**overrides, "placement.mode": "colocated"}
    with pytest.raises(PlanError, match="^run config: placement.mode: a colocated run samples"):
        plan_training({**params, "run_id": "r4", "overrides": colocated}, "manual__d")


def test_the_heldout_task_evaluates_during_training_only_on_devices_of_its_own(tmp_path):
    """The plan's heldout job: `rlax heldout --every N` from the run's trained step with
    placement.evaluator; none when no version before the last is due, or without devices of its
    own (a cpu run too: under dag.test a second watcher would hold the controller's back)."""
    every = {"eval.every_steps": 2, "placement.evaluator": [0]}
    p = plan_training(tiny_params(tmp_path, "r1", steps=5, overrides=every), "manual__a")
    assert p.heldout.argv == [
        "heldout", "--config", p.config_path, "--every", "2", "--after", "0"
    ]  # fmt: skip
    assert p.heldout.env["JAX_PLATFORMS"] == "cpu"
    p = plan_training(tiny_params(tmp_path, "r2", steps=2, overrides=every), "manual__b")
    assert p.heldout.argv == []  # version 2 is the last: the evaluate task's
    shared = {"eval.every_steps": 2}  # the cpu run's devices: not beside training in the DAG
    p = plan_training(tiny_params(tmp_path, "r5", steps=5, overrides=shared), "manual__e")
    assert p.heldout.argv == []
    gpu = {
        **shared, "placement.platform": "gpu", "placement.mode": "colocated",
        "placement.trainer": [0], "model.dtype": "bfloat16",
    }  # fmt: skip
    p = plan_training(tiny_params(tmp_path, "r3", steps=5, overrides=gpu), "manual__c")
    assert p.heldout.argv == []  # on the trainer's GPU: before and after only
    own = {**gpu, "placement.evaluator": [1]}
    p = plan_training(tiny_params(tmp_path, "r4", steps=5, overrides=own), "manual__d")
    assert p.heldout.argv[:5] == ["heldout", "--config", p.config_path, "--every", "2"]
    assert p.heldout.env["CUDA_VISIBLE_DEVICES"] == "1"


def test_workers_share_the_trainer_slice_unless_told(tmp_path):
    params = tiny_params(
        tmp_path, "r2", num_workers=2, overrides={"placement.mode": "disaggregated"}
    )
    p = plan_training(params, "manual__d")  # the local backend
    assert [s.role for s in p.slices] == ["trainer"]
    assert {w.slice for w in p.workers} == {"trainer"}
    assert (p.controller.slice, p.controller.hosts) == ("trainer", (0,))
    # local worker slices are this machine: one host each, whatever type is named
    local = plan_training(
        {**params, "worker_accelerator_type": "v4-16", "worker_slices": 2, "num_workers": None},
        "manual__e",
    )
    assert [(w.slice, w.hosts) for w in local.workers] == [("workers-0", (0,)), ("workers-1", (0,))]


def test_a_model_that_cannot_fit_the_slice_is_refused_before_provisioning(tmp_path, monkeypatch):
    """Qwen2.5-7B shapes with float32 master weights and Adam on a v5litepod-8 trainer slice:
    one line naming accelerator_type and the chip's memory, nothing written (no
    placement.accelerator set: the slice's type decides)."""
    from tests.plan.test_slice_memory import QWEN_7B, model_dir

    monkeypatch.setenv("RLAX_BACKEND", "cloud_tpu")
    params = {
        "preset": "tiny-arith",
        "run_root": str(tmp_path / "runs"),
        "steps": 2,
        "model_path": str(model_dir(tmp_path, "qwen7b", QWEN_7B)),
        "accelerator_type": "v5litepod-8",
    }
    with pytest.raises(PlanError) as info:
        plan_training(params, "manual__big")
    message = str(info.value)
    assert "\n" not in message
    # the tiny preset runs colocated: trainer and sampler on the slice's chips together
    assert message.startswith("accelerator_type: v5litepod-8: colocated needs")
    assert "a v5e chip has 16.0 GiB" in message
    assert not (tmp_path / "runs").exists()


def test_curation_and_evaluation_slices_are_one_host_types_on_cloud_tpu():
    assert slices.single_host_slice(None, "local") == ("cpu", "")  # the local backend, as before
    v5e = slices.single_host_slice("v5litepod-1", "cloud_tpu")
    assert v5e == ("v5litepod-1", "v2-alpha-tpuv5-lite")
    assert slices.single_host_slice("v4-8", "cloud_tpu") == ("v4-8", "tpu-ubuntu2204-base")
    with pytest.raises(PlanError, match="^accelerator_type: accelerator type 'cpu' is not"):
        slices.single_host_slice("cpu", "cloud_tpu")
    with pytest.raises(PlanError, match="^accelerator_type: v4-16 has 2 hosts but this job"):
        slices.single_host_slice("v4-16", "cloud_tpu")


def test_plan_refuses_a_resume_that_changes_training_unless_allowed(tmp_path):
    """The plan task shares `rlax run`'s resume check (docs/design.md §13): a changed learning rate
    fails the plan, naming the field and the Param that accepts it; with the Param it plans and
    config_changes.jsonl records the change."""
    from rlax_tasks.rundir.paths import run_paths

    params = tiny_params(tmp_path, "resumed")
    plan_training(params, "manual__1")
    changed = {**params, "overrides": {"trainer.learning_rate": 0.5}}
    with pytest.raises(PlanError, match="trainer.learning_rate.*allow_config_change") as info:
        plan_training(changed, "manual__2")
    assert "\n" not in str(info.value)
    plan_training({**changed, "allow_config_change": True}, "manual__3")
    with open(run_paths(str(tmp_path / "runs" / "resumed")).config_changes) as f:
        assert "trainer.learning_rate" in f.read()


def test_plan_refuses_a_dataset_it_cannot_read(tmp_path):
    missing = str(tmp_path / "nowhere.jsonl")
    params = tiny_params(tmp_path, "nodata")
    with pytest.raises(PlanError, match="nowhere.jsonl") as info:  # the curated dataset
        plan_training(params, "manual__1", dataset=missing, verifier="math")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "runs" / "nodata" / "config.yaml").exists()  # refused before writing


def test_the_report_task_compares_the_starting_weights_with_the_trained_ones(tmp_path):
    """The DAG's report task writes `rlax run`'s eval/report.md: pass@k of eval/v0 against the
    newest evaluated version, the steps and the time the metrics span; without the v0
    evaluation it names what is missing."""
    from rlax_tasks.rundir.paths import run_paths
    from tests.evaluation.test_history import write_results

    run_dir = plan_training(tiny_params(tmp_path, "reported", steps=6), "manual__1").run_dir
    paths = run_paths(run_dir)
    write_results(run_dir, 6, 0.5)
    with pytest.raises(FileNotFoundError, match=r"starting weights \(v0\).*found \['v6'\]"):
        eval_planning.write_run_report(run_dir)
    write_results(run_dir, 0, 0.25)
    write_results(run_dir, 3, 0.4)  # an earlier evaluation: the newest is "after"
    with open(paths.metrics, "w") as f:
        for step, t in ((1, 100.0), (6, 142.5)):
            f.write(json.dumps({"step": step, "time": t, "reward_mean": 0.5}) + "\n")
    assert eval_planning.write_run_report(run_dir) == paths.report_md
    with open(paths.report_md) as f:
        text = f.read()
    assert "Training: 6 steps in 42 s." in text  # 142.5 - 100.0, rounded
    assert "| pass@1 | 0.250 | 0.500 | +0.250 |" in text
    with open(paths.report_json) as f:
        summary = json.load(f)
    assert summary["before"]["version"] == 0 and summary["after"]["version"] == 6
    assert os.path.isfile(os.path.join(paths.eval, "pass_at_k.png"))
    assert not os.path.exists(paths.eval_progress)  # no heldout task results: no curve

    # the heldout task's results during training: the report's curve between before and after
    from rlax_tasks.run.heldout import append_row
    from rlax_tasks.rundir import storage

    append_row(run_dir, {"evaluating": 2, "time": 1.0})
    append_row(run_dir, {"version": 2, "pass@1": 0.3, "pass@4": 0.6, "seconds": 1.0})
    append_row(run_dir, {"version": 4, "pass@1": 0.45, "pass@4": 0.7, "seconds": 1.0})
    for _ in range(2):  # a retried report task writes the curve anew
        eval_planning.write_run_report(run_dir)
    curve = storage.read_jsonl(paths.eval_progress)
    assert [(r["step"], r["pass@1"]) for r in curve] == [(0, 0.25), (2, 0.3), (4, 0.45), (6, 0.5)]
    assert curve[-1]["seconds"] == 42.5  # from the first step's time


def test_the_plan_is_the_xcom_and_comes_back_whole(tmp_path):
    """The plan task returns ``to_dict()``: JSON (an Airflow 3 XCom), one key per field, read
    back by the tasks as the same TrainingPlan; a dict of another shape (the old flat keys) is
    refused, naming the key."""
    from rlax_tasks.plan.run_plan import PlanFormatError

    params = tiny_params(
        tmp_path, "xcom", num_workers=2, overrides={"placement.mode": "disaggregated"}
    )
    plan = plan_training(params, "manual__x")
    xcom = json.loads(json.dumps(plan.to_dict()))
    assert TrainingPlan.from_dict(xcom) == plan
    assert TrainingPlan.from_dict(xcom).to_dict() == xcom
    assert xcom["trainer"]["argv"][0] == "trainer" and len(xcom["workers"]) == 2
    with pytest.raises(PlanFormatError, match=r"^plan: .*unknown key\(s\) \['argv_ps'\]"):
        TrainingPlan.from_dict({**xcom, "argv_ps": xcom["ps"]["argv"]})
    with pytest.raises(PlanFormatError, match=r"^plan: .*missing key\(s\) \['eval_env'\]"):
        TrainingPlan.from_dict({k: v for k, v in xcom.items() if k != "eval_env"})
    worker = {k: v for k, v in xcom["workers"][1].items() if k != "hosts"}
    with pytest.raises(
        PlanFormatError, match=r"^plan\['workers'\]\[1\]: .*missing key\(s\) \['hosts'\]"
    ):
        TrainingPlan.from_dict({**xcom, "workers": [xcom["workers"][0], worker]})


def test_a_watcher_runs_the_job_of_the_plan_it_is_given(tmp_path):
    """planned_job: the operator takes argv, env and hosts from the plan's job (as the DAG hands
    it: rendered from the XCom), and refuses a job dict that is not one, naming the key."""
    from airflow.sdk.exceptions import AirflowFailException

    params = tiny_params(
        tmp_path, "watched", num_workers=2, overrides={"placement.mode": "disaggregated"}
    )
    plan = plan_training(params, "manual__w")
    op = rc.planned_job("trainer", "runs", {}, plan.trainer.to_dict())
    spec = op._job_spec({})
    assert (spec.argv, spec.env, spec.hosts) == (plan.trainer.argv, plan.trainer.env, (0,))
    assert "job" in op.template_fields  # an XComArg of the plan, resolved when the task runs
    broken = {k: v for k, v in plan.ps.to_dict().items() if k != "env"}
    with pytest.raises(AirflowFailException, match=r"^ps: job: .*missing key\(s\) \['env'\]"):
        rc.planned_job("ps", "runs", {}, broken)._job_spec({})


def test_params_that_the_run_config_refuses_are_named(tmp_path):
    """config_from_params maps each Param onto its field; a value the run config refuses names
    the Param first (the overrides Param's fields: "run config"), and an unknown Param too."""
    params = tiny_params(tmp_path, "named")
    with pytest.raises(PlanError, match=r"^max_staleness: staleness.max_staleness: must be >="):
        plan_training({**params, "reload_every": 3, "max_staleness": 2}, "manual__1")
    with pytest.raises(PlanError, match=r"^algorithm: algorithm.preset: unknown objective"):
        plan_training({**params, "algorithm": "sgd"}, "manual__2")
    with pytest.raises(PlanError, match=r"^max_stalenes: not a Param of rlax_train.*max_staleness"):
        plan_training({**params, "max_stalenes": 2}, "manual__3")
    with pytest.raises(PlanError, match=r"^run config: staleness.max_staleness: must be >="):
        plan_training({**params, "overrides": {"staleness.reload_every": 4}}, "manual__4")
    with pytest.raises(PlanError, match=r"^preset: unknown preset 'tiny-arithm'"):
        plan_training({**params, "preset": "tiny-arithm"}, "manual__5")
    assert not (tmp_path / "runs" / "named").exists()  # refused before anything was written
    plan = plan_training({**params, "reload_every": 2, "max_staleness": None}, "manual__6")
    from rlax_tasks.airflow.eval_planning import load_run_config

    staleness = load_run_config(plan.run_dir).staleness
    assert (staleness.reload_every, staleness.max_staleness) == (2, None)


def test_the_ps_replicas_param_plans_a_task_per_replica(tmp_path):
    """ps_replicas=3 on four workers: the plan carries ps-1 and ps-2 as jobs of their own, the
    DAG's mapped ps_replica task gets one each (on the trainer slice), start_services names
    them as those tasks do; a count the config refuses names the Param."""
    params = tiny_params(
        tmp_path, "replicas", num_workers=4, overrides={"placement.mode": "disaggregated"}
    )
    plan = plan_training({**params, "ps_replicas": 3}, "manual__r")
    assert [r.name for r in plan.ps_replicas] == ["ps-1", "ps-2"]
    assert all(r.argv[:2] == ["ps", "serve"] and "--upstream" in r.argv for r in plan.ps_replicas)
    mapped = rc.replica_jobs(plan, {"trainer": {"slice": "t"}})
    assert [m["job"]["name"] for m in mapped] == ["ps-1", "ps-2"]
    assert all(m["slice_handle"] == {"slice": "t"} for m in mapped)
    homes = [w.argv[w.argv.index("--ps-url") + 1] for w in plan.workers]
    assert len(set(homes)) == 3 and homes[0] == homes[3] == plan.ps_url
    with pytest.raises(PlanError, match=r"^ps_replicas: paramserver.replicas: 5 replicas for 4"):
        plan_training({**params, "ps_replicas": 5}, "manual__r5")
