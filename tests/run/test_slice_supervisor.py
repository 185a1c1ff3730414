"""`rlax run` on a backend's slices: which slices a run takes and what runs on each host
(`run_slices`, `node_plan`, `rlax run --backend ray --dry-run`), and the SliceSupervisor's
restart rules over a real backend (the local one, running the stand-in job program)."""

from __future__ import annotations

import os

import pytest

from rlax_tasks.cli import main
from rlax_tasks.compute import JobState, get_backend
from rlax_tasks.config import load_config
from rlax_tasks.plan.topology import WorkerSlices, worker_place
from rlax_tasks.run.slice_supervisor import SliceSupervisor, node_plan, run_slices
from rlax_tasks.run.supervisor import Component, ComponentFailed
from tests.compute.helpers import ENTRYPOINT, wait_for

TWO_CPU_HOSTS = {
    "placement.mode": "disaggregated",
    "trainer.hosts": 2,
    "workers.count": 2,
    "placement.trainer": [0, 1],
}


def test_cpu_hosts_give_the_trainer_a_slice_and_each_worker_its_own():
    cfg = load_config("tiny-arith", TWO_CPU_HOSTS)
    slices = run_slices(cfg)
    assert slices.types == {"trainer": "2xcpu", "workers-0": "cpu", "workers-1": "cpu"}
    assert slices.workers == WorkerSlices(2, 1)
    assert node_plan(cfg) == [
        "slice trainer (2xcpu) host 0: trainer (host 0 of 2, cpu 0,1), ps (cpu), controller (cpu)",
        "slice trainer (2xcpu) host 1: trainer (host 1 of 2, cpu 0,1)",
        "slice workers-0 (cpu) host 0: worker-0 (cpu)",
        "slice workers-1 (cpu) host 0: worker-1 (cpu)",
    ]


def test_gpu_hosts_are_whole_nodes_each_with_its_share_of_trainer_and_workers():
    cfg = load_config("qwq-32b-code")
    slices = run_slices(cfg)
    assert slices.types == {"trainer": "8xgpu-8"} and slices.workers is None
    assert [worker_place(cfg, i) for i in range(8)] == [("trainer", (h,)) for h in range(8)]
    lines = node_plan(cfg)
    assert len(lines) == 8
    assert lines[0] == (
        "slice trainer (8xgpu-8) host 0: trainer (host 0 of 8, gpu 0-3), ps (cpu), "
        "controller (cpu), worker-0 (gpu 4-7)"
    )
    assert lines[7] == (
        "slice trainer (8xgpu-8) host 7: trainer (host 7 of 8, gpu 0-3), worker-7 (gpu 4-7)"
    )


def test_rlax_run_dry_run_on_ray_prints_each_node_then_the_memory_plan(capsys):
    assert main(["run", "--preset", "qwq-32b-code", "--dry-run", "--backend", "ray"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Ray nodes (one per host of a slice; each slice a placement group):\n")
    assert "  slice trainer (8xgpu-8) host 7: trainer (host 7 of 8, gpu 0-3)" in out
    assert "memory per device" in out  # the plan follows, per job as on any backend


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--preset", "tiny-arith", "--run-id", "qwen2.5-run"],
         "run_id: 'qwen2.5-run' labels the run's slices"),
        (["--preset", "qwen2.5-math-1.5b-grpo-tpu", "--run-id", "tpu"],
         "placement.platform: tpu: `rlax run --backend ray` places GPU and CPU hosts"),
    ],
)  # fmt: skip
def test_what_cannot_take_ray_slices_is_one_line(argv, says, capsys):
    assert main(["run", *argv, "--dry-run", "--backend", "ray"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err


def test_an_address_without_the_ray_backend_is_refused(capsys):
    assert main(["run", "--preset", "tiny-arith", "--address", "10.0.0.2:6379"]) == 2
    assert "--address: the Ray cluster's address goes with --backend ray" in capsys.readouterr().err


def _supervisor(tmp_path) -> SliceSupervisor:
    backend = get_backend(
        "local", run_root=str(tmp_path / "runs"), entrypoint=ENTRYPOINT, stop_grace_s=2.0
    )
    sup = SliceSupervisor(
        backend,
        "r1",
        str(tmp_path / "logs"),
        {"trainer": "cpu"},
        run_root=str(tmp_path / "runs"),
        poll_interval_s=0.0,
    )
    sup.provision(timeout_s=30)
    return sup


@pytest.fixture
def supervisor(tmp_path):
    sup = _supervisor(tmp_path)
    yield sup
    sup.stop()


def test_a_resume_tears_down_what_a_killed_rlax_run_left_running(tmp_path):
    first = _supervisor(tmp_path)
    first.add(Component("ps", ["sleep", "120"]))
    job = first.job_handle("ps")
    assert first.backend.job_state(job).state is JobState.RUNNING
    # (the first `rlax run` is gone without stopping anything: the next one starts clean)
    second = _supervisor(tmp_path)
    try:
        assert first.backend.job_state(job).state is not JobState.RUNNING
        second.add(Component("ps", ["sleep", "120"]))
        assert second.backend.job_state(second.job_handle("ps")).state is JobState.RUNNING
    finally:
        second.stop()


def _poll_until(sup, done):
    return wait_for(lambda: done(sup.poll()) or None, timeout_s=30)


def test_a_job_that_may_finish_finishes_and_its_log_is_linked(supervisor):
    supervisor.add(Component("controller", ["exit", "0"], restart=False))
    assert _poll_until(supervisor, lambda finished: finished.get("controller") == 0) is not None
    log = open(supervisor.log_path("controller")).read()
    assert "exiting with 0" in log
    assert supervisor.components["controller"].restarts == 0


def test_a_user_error_stops_the_run_with_the_jobs_own_line(supervisor):
    supervisor.add(Component("trainer", ["exit", "2"]))
    with pytest.raises(ComponentFailed) as e:
        wait_for(lambda: supervisor.poll() and None, timeout_s=30)
    assert str(e.value).startswith("trainer failed: ") and "log: " in str(e.value)


def test_a_failed_service_is_restarted_and_the_same_failure_twice_stops_it(supervisor):
    supervisor.progress = lambda: 0  # no progress between the failures
    supervisor.add(Component("ps", ["fail", "the disk is full"]))
    with pytest.raises(ComponentFailed) as e:
        wait_for(lambda: supervisor.poll() and None, timeout_s=60)
    assert "failed twice in a row with the same error and no progress in between: " in str(e.value)
    assert "RuntimeError: the disk is full" in str(e.value)
    assert supervisor.components["ps"].restarts == 1  # restarted once, then given up
    assert os.path.islink(supervisor.log_path("ps"))
