"""The fault drills of rlax_train under a real Airflow scheduler and triggerer, not `dag.test()`:
Airflow's components as separate processes (``Components`` in tests/dags/standalone.py, SQLite
and the LocalExecutor as `airflow standalone`), the tiny preset's colocated run (one `rlax
colocated` job, watched by the controller task deferred on a JobStateTrigger).

Once the job has checkpointed a step it is held mid-run (SIGSTOP: its runner keeps the heartbeat
going, so the job stays RUNNING however long the drills take on a slow machine), and then
1. the triggerer is SIGKILLed with its trigger runner and started again: the new triggerer takes
   over the same trigger (the task stays deferred on it) and the job is left alone;
2. the scheduler is SIGKILLed with its executor workers and started again: the same;
3. the job is SIGKILLed: the new triggerer sees it preempted, the new scheduler retries the
   task, whose new job resumes from the newest checkpoint;
and the DAG run succeeds with every training step applied exactly once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest

from rlax_tasks.rundir import storage
from tests.dags.conftest import read_jsonl
from tests.dags.standalone import Components, tail, wait_for

RUN_ID = "faults"
STEPS = 8
CHECKPOINT_EVERY = 2
RUN_TIMEOUT_S = 600
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _job_process(tag: str) -> psutil.Process | None:
    """The `rlax colocated` process of the test's run (not its runner): found by the test tag
    in its environment and its command line."""
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if cmd[1:4] != ["-m", "rlax_tasks.cli", "colocated"]:
            continue
        try:
            if proc.environ().get("RLAX_TEST_TAG") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                return proc
        except psutil.Error:
            continue
    return None


def _signal_tree(proc: psutil.Process, sig: int) -> None:
    """``sig`` to ``proc`` and its descendants (holding a job: none of it may run)."""
    try:
        tree = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return  # gone
    for p in tree:
        try:
            p.send_signal(sig)
        except psutil.Error:
            pass


def _checkpoints(run_dir: str) -> list[int]:
    """Committed checkpoint steps (Orbax renames a finished step's directory to its number)."""
    try:
        return sorted(
            int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints")) if n.isdigit()
        )
    except FileNotFoundError:
        return []


def _controller_jobs(jobs_dir: str) -> list[str]:
    """The controller's job directories: its job, and each earlier attempt archived as
    ``controller.<n>`` when the job was started again."""
    return sorted(n for n in os.listdir(jobs_dir) if n.split(".")[0] == "controller")


def _controller(airflow: Components, dag_run_id: str) -> dict[str, Any]:
    (ti,) = [t for t in airflow.task_instances(dag_run_id) if t["task_id"] == "controller"]
    return ti


def _deferred_trigger(
    airflow: Components, dag_run_id: str, stays: bool = False
) -> dict[str, Any] | None:
    """The controller task's trigger while it is deferred and held by a triggerer (``stays``:
    the task must not have left the deferred state)."""
    ti = _controller(airflow, dag_run_id)
    trigger = ti.get("trigger") or {}
    if stays and ti["state"] != "deferred":
        raise AssertionError(f"the controller task left its trigger: {ti['state']}")
    if ti["state"] == "deferred" and trigger.get("triggerer_id") is not None:
        return trigger
    return None


def _api(check: Callable[[], Any]) -> Callable[[], Any]:
    """``check`` for ``wait_for``, a busy api-server's timeout taken as "not yet" (2 cores)."""

    def polled() -> Any:
        try:
            return check()
        except OSError as e:
            print(f"api-server: {e!r}", flush=True)
            return None

    return polled


def _newest_job_id(airflow: Components, job_type: str) -> int:
    jobs = airflow.get(f"/api/v2/jobs?job_type={job_type}&is_alive=true&limit=100")["jobs"]
    return max((j["id"] for j in jobs), default=0)


@pytest.fixture(scope="module")
def airflow(tmp_path_factory):
    """api-server, scheduler, dag-processor and triggerer, ready with rlax_train parsed; all
    stopped at the end, with every process carrying the test's tag (the `rlax` jobs too)."""
    components = Components(str(tmp_path_factory.mktemp("airflow-components")))
    try:
        components.start()
        yield components
    finally:
        leftovers = components.stop()
        if leftovers:
            print("killed after the grace period:\n  " + "\n  ".join(leftovers))


def test_a_killed_job_and_restarted_components_complete_the_run_once(airflow, tmp_path):
    from tests.tiny_model import save_char_model

    started = time.monotonic()

    def note(what: str) -> None:  # the drills' timeline, for the log of a slow or failed run
        print(f"{time.monotonic() - started:6.1f}s {what}", flush=True)

    model = str(tmp_path / "model")
    save_char_model(model)  # while Airflow starts
    airflow.wait_ready()
    note("airflow ready")
    run_dir = os.path.join(airflow.run_root, RUN_ID)
    jobs_dir = os.path.join(run_dir, "slices", f"rlax-{RUN_ID}-trainer", "jobs")
    conf = {
        "run_id": RUN_ID,
        "steps": STEPS,
        "model_path": model,
        "overrides": {
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 4,
            "workers.slots": 16,
            "trainer.checkpoint_every": CHECKPOINT_EVERY,
            "eval.num_prompts": 8,
            "eval.num_samples": 2,
            "eval.ks": [1, 2],
        },
    }
    dag_run_id, held = None, None
    try:
        dag_run_id = airflow.trigger(conf)
        note(f"triggered {dag_run_id}")

        # the job, held once it has checkpointed a step (not yet at the last one)
        job = wait_for("the rlax colocated job", lambda: _job_process(airflow.tag), 300, 0.2)
        wait_for("a checkpoint", lambda: _checkpoints(run_dir), 300, 0.05)
        _signal_tree(job, signal.SIGSTOP)
        held = job
        note(f"job {job.pid} held after checkpoint {_checkpoints(run_dir)[-1]}")
        # a process stopped mid-write leaves a torn last line: storage.read_jsonl skips it
        metrics = storage.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        steps_before = [m["step"] for m in metrics]
        assert steps_before and max(steps_before) < STEPS, (
            f"the job was held at step {max(steps_before, default=0)} of {STEPS}: not mid-run"
        )
        trigger = wait_for(
            "the controller task deferred",
            _api(lambda: _deferred_trigger(airflow, dag_run_id)),
            120,
        )

        # 1. the triggerer dies and comes back: the same trigger moves to the new one
        airflow.kill_component("triggerer")
        airflow.start_component("triggerer")

        def taken_over() -> dict[str, Any] | None:
            now = _deferred_trigger(airflow, dag_run_id, stays=True)
            return now if now and now["triggerer_id"] != trigger["triggerer_id"] else None

        moved = wait_for("the new triggerer to take the trigger over", _api(taken_over), 120)
        note(
            f"trigger {moved['id']}: triggerer {trigger['triggerer_id']} -> {moved['triggerer_id']}"
        )
        assert moved["id"] == trigger["id"], (trigger, moved)  # not resumed and deferred anew

        # 2. the scheduler dies and comes back: the task stays deferred on the same trigger
        before = _newest_job_id(airflow, "SchedulerJob")
        airflow.kill_component("scheduler")
        airflow.start_component("scheduler")

        def scheduler_back() -> bool:
            _deferred_trigger(airflow, dag_run_id, stays=True)
            return _newest_job_id(airflow, "SchedulerJob") > before

        wait_for("the new scheduler alive", _api(scheduler_back), 120)
        note("scheduler restarted")
        after = _deferred_trigger(airflow, dag_run_id, stays=True)
        assert after is not None and after["id"] == trigger["id"], after

        # the job went through both untouched: the same process, never restarted
        assert job.is_running() and job.status() == psutil.STATUS_STOPPED
        assert _job_process(airflow.tag).pid == job.pid
        assert _controller_jobs(jobs_dir) == ["controller"], os.listdir(jobs_dir)
        assert not os.path.exists(os.path.join(jobs_dir, "controller", "exit.json"))

        # 3. the job dies mid-run: the task is retried and its new job resumes
        newest_checkpoint = _checkpoints(run_dir)[-1]
        _signal_tree(job, signal.SIGKILL)
        held = None
        note(f"job {job.pid} killed")

        def finished() -> str | None:
            state = airflow.dag_run(dag_run_id)["state"]
            return state if state in ("success", "failed") else None

        state = wait_for(f"DAG run {dag_run_id} to finish", _api(finished), RUN_TIMEOUT_S, 2)
        note(f"DAG run {state}")
        assert state == "success", f"DAG run {dag_run_id} ended {state}"

        # one retry of the controller task, one restart of the job (the killed one archived)
        assert _controller(airflow, dag_run_id)["try_number"] == 2
        assert _controller_jobs(jobs_dir) == ["controller", "controller.1"], os.listdir(jobs_dir)
        with open(os.path.join(jobs_dir, "controller.1", "heartbeat")) as f:
            assert json.load(f)["pid"] == job.pid
        with open(os.path.join(jobs_dir, "controller.1", "exit.json")) as f:
            assert json.load(f)["returncode"] == -signal.SIGKILL
        # the new job restored the newest checkpoint instead of starting over
        stderr = tail(os.path.join(jobs_dir, "controller", "stderr.log"), 10_000)
        restored = re.search(r"trainer at step (\d+) \(restored\)", stderr)
        assert restored and int(restored.group(1)) == newest_checkpoint, stderr[-2000:]
        # every step applied once, in order, across the kill; the metrics reach the last one
        lineage = read_jsonl(os.path.join(run_dir, "lineage.jsonl"))
        assert [r["step"] for r in lineage] == list(range(1, STEPS + 1))
        consumed = [p for r in lineage for p in r["prompt_ids"]]
        assert len(consumed) == len(set(consumed)) == STEPS * 4
        metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
        assert sorted({m["step"] for m in metrics}) == list(range(1, STEPS + 1))
        with open(os.path.join(run_dir, "status.json")) as f:
            assert json.load(f)["state"] == "succeeded"
    except Exception as e:
        report = airflow.report(dag_run_id, RUN_ID)
        raise AssertionError(f"{type(e).__name__}: {e}\n\n{report}") from e
    finally:
        if held is not None:  # let it take the stop signals
            _signal_tree(held, signal.SIGCONT)
