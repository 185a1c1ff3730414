"""The TrainingPlan: what `rlax run` launches and the rlax_train DAG's plan task returns. Its
dict round-trips exactly through JSON and a dict of another shape is refused, naming the key."""

from __future__ import annotations

import json

import pytest

from rlax_tasks.plan.run_plan import Job, PlanFormatError, SlicePlan, TrainingPlan


def _plan(**extra) -> TrainingPlan:
    worker = Job("worker-0", ["worker", "--worker-id", "worker-0"], {"A": "1"}, "workers-0")
    return TrainingPlan(
        run_id="r1", run_root="/runs", run_dir="/runs/r1", config_path="/runs/r1/config.yaml",
        steps=4, ps_url="/runs/r1/services/ps.json", done_marker="/runs/r1/DONE",
        ps=Job("ps", ["ps", "serve"], {"JAX_PLATFORMS": "cpu"}),
        trainer=Job("trainer", ["trainer"], {"T": "x"}, hosts=(0, 1)),
        workers=(worker,), controller=Job("controller", ["controller"], {}, service=False),
        heldout=Job.unplanned("heldout"), eval_env={"T": "x"},
        slices=(SlicePlan("trainer", "rlax-r1-trainer", "v4-16", "tpu-ubuntu2204-base"),),
        **extra,
    )  # fmt: skip


def test_the_plan_round_trips_through_json_exactly():
    plan = _plan(runtime_version="tpu-ubuntu2204-base")
    raw = json.loads(json.dumps(plan.to_dict()))
    assert TrainingPlan.from_dict(raw) == plan
    assert TrainingPlan.from_dict(raw).to_dict() == raw == plan.to_dict()
    assert raw["trainer"]["hosts"] == [0, 1] and raw["slices"][0]["accelerator_type"] == "v4-16"
    assert [j.name for j in plan.jobs()] == ["ps", "trainer", "worker-0", "controller"]
    assert not plan.colocated


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("ps"), r"^plan: not a TrainingPlan \(missing key\(s\) \['ps'\]\)"),
        (lambda d: d.update(argv_ps=[]), r"^plan: .*unknown key\(s\) \['argv_ps'\]"),
        (lambda d: d["trainer"].pop("hosts"), r"^plan\['trainer'\]: .*\['hosts'\]"),
        (lambda d: d["slices"][0].update(zone="z"), r"^plan\['slices'\]\[0\]: .*\['zone'\]"),
        (lambda d: d.update(workers=[["worker"]]), r"^plan\['workers'\]\[0\]: expected a map"),
    ],
)
def test_a_dict_of_another_shape_is_refused_naming_the_key(change, message):
    raw = _plan().to_dict()
    change(raw)
    with pytest.raises(PlanFormatError, match=message):
        TrainingPlan.from_dict(raw)


def test_processes_split_a_multi_host_job_only_with_a_coordinator():
    plan = _plan(coordinator="127.0.0.1:9000")
    names = [(name, env.get("RLAX_PROCESS_ID")) for name, _, env in plan.processes()]
    assert ("trainer", "0") in names and ("trainer-host1", "1") in names
    with pytest.raises(ValueError, match="slices run jobs whole"):
        _plan().processes()
