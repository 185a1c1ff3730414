"""Operators run through execute / execute_complete with a minimal context; the triggers they
defer to are rebuilt from ``serialize()`` (as the triggerer does) and driven by asyncio, against
real backends (local processes; cloud_tpu with the real client against the fake API)."""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import types
from typing import Any

import pytest
from airflow.sdk.exceptions import (
    AirflowException,
    AirflowFailException,
    AirflowRescheduleException,
    TaskDeferred,
)

from rlax_tasks.airflow import (
    JobFailedError,
    JobPreemptedError,
    JobStateTrigger,
    ProvisionSliceOperator,
    RlaxJobOperator,
    SliceReadyTrigger,
    TeardownSliceOperator,
    start_jobs,
)
from rlax_tasks.compute import JobState, SliceSpec, SliceState, get_backend
from tests.compute.helpers import (
    ENTRYPOINT,
    fake_backend_settings,
    fake_cloud_tpu,
    preempt,
    read_counter,
    wait_for,
)


class _TI:
    """What an operator reads of its task instance (the task runner's RuntimeTaskInstance):
    its map index, try number and, with ``states``, the run's task states."""

    def __init__(self, map_index: int = -1, states: dict[str, str] | None = None) -> None:
        self.map_index = map_index
        self.try_number = 1
        self.states = states

    def get_task_states(self, dag_id: str, run_ids: list[str]) -> dict[str, dict[str, str]]:
        assert dag_id == "rlax_train"
        return {run_ids[0]: dict(self.states or {})}


def context(map_index: int = -1, states: dict[str, str] | None = None) -> dict[str, Any]:
    ctx: dict[str, Any] = {"ti": _TI(map_index, states)}
    if states is not None:
        ctx["dag_run"] = types.SimpleNamespace(dag_id="rlax_train", run_id="manual__1")
    return ctx


def rebuild(trigger):
    """What the triggerer does: import the class path and construct it from the kwargs."""
    classpath, kwargs = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    json.dumps(kwargs)  # trigger kwargs must be JSON-serialisable
    return getattr(importlib.import_module(module), name)(**kwargs)


def fire(trigger, timeout_s: float = 60.0) -> dict[str, Any]:
    async def first_event():
        async for event in rebuild(trigger).run():
            return event.payload
        raise AssertionError("trigger ended without an event")

    return asyncio.run(asyncio.wait_for(first_event(), timeout_s))


def run_deferrable(op, ctx: dict[str, Any]) -> Any:
    """Runs an operator the way the task runner does: execute, then resume after each defer."""
    method, kwargs = op.execute, {}
    while True:
        try:
            return method(ctx, **kwargs)
        except TaskDeferred as deferred:
            kwargs = {"event": fire(deferred.trigger), **(deferred.kwargs or {})}
            method = getattr(op, deferred.method_name)


@pytest.fixture
def local(tmp_path):
    return {"run_root": str(tmp_path / "runs"), "entrypoint": ENTRYPOINT, "stop_grace_s": 2.0}


def provision(settings, backend="local", **kw):
    op = ProvisionSliceOperator(
        task_id="provision",
        backend=backend,
        backend_settings=settings,
        name=kw.pop("name", "main"),
        labels={"rlax-run-id": "r1"},
        poll_interval_s=0.1,
        **kw,
    )
    return run_deferrable(op, context())


def job_op(settings, handle, argv, backend="local", **kw):
    return RlaxJobOperator(
        task_id=kw.pop("task_id", "trainer"),
        backend=backend,
        backend_settings=settings,
        slice_handle=handle,
        argv=argv,
        poll_interval_s=0.1,
        **kw,
    )


def test_success_defers_to_the_job_trigger(local):
    handle = provision(local)
    assert handle["name"] == "main" and handle["backend"] == "local"
    op = job_op(local, handle, ["exit", "0"])
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context())
    assert isinstance(deferred.value.trigger, JobStateTrigger)
    assert deferred.value.method_name == "execute_complete"
    event = fire(deferred.value.trigger)
    assert event["state"] == "SUCCEEDED"
    result = op.execute_complete(context(), event=event)
    assert result["exit_code"] == 0 and result["job"]["name"] == "trainer"


def test_configuration_error_is_not_retried(local):
    handle = provision(local)
    with pytest.raises(AirflowFailException, match="configuration error"):
        run_deferrable(job_op(local, handle, ["exit", "2"]), context())


def test_other_failures_are_retryable(local):
    handle = provision(local)
    with pytest.raises(JobFailedError, match="exit code 3") as err:
        run_deferrable(job_op(local, handle, ["exit", "3"]), context())
    assert isinstance(err.value, AirflowException)
    assert not isinstance(err.value, AirflowFailException)


def test_killed_job_is_preempted_and_the_retry_resumes(local, tmp_path):
    handle = provision(local)
    ckpt = str(tmp_path / "ckpt")
    op = job_op(local, handle, ["count", ckpt, "20", "0.05"], heartbeat_timeout_s=5)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute(context())
    wait_for(lambda: read_counter(ckpt) >= 2)
    status_dir = deferred.value.trigger.job_handle["status_dir"]
    child = json.load(open(os.path.join(status_dir, "heartbeat")))["pid"]
    os.kill(child, signal.SIGKILL)
    event = fire(deferred.value.trigger)
    assert event["state"] == "PREEMPTED"
    with pytest.raises(JobPreemptedError) as err:
        op.execute_complete(context(), event=event)
    assert not isinstance(err.value, AirflowFailException)
    # the retry (a fresh operator run, as Airflow does) starts the job again; it resumes
    result = run_deferrable(op, context())
    assert result["exit_code"] == 0 and read_counter(ckpt) == 20
    with open(os.path.join(status_dir, "stdout.log")) as fh:
        assert int(fh.read().split("resumed from step ")[1].split()[0]) >= 2


def test_retry_reprovisions_a_lost_slice_and_teardown_is_idempotent(local):
    handle = provision(local)
    backend = get_backend("local", **local)
    backend.teardown(handle)  # the slice is gone before the (retried) job starts
    result = run_deferrable(job_op(local, handle, ["exit", "0"]), context())
    new_slice = result["job"]["slice"]
    assert new_slice["name"] == "main" and new_slice["instance_id"] != handle["instance_id"]
    assert backend.slice_state(new_slice) is SliceState.READY
    teardown = TeardownSliceOperator(
        task_id="teardown", backend="local", backend_settings=local, slice_handle=handle
    )
    assert teardown.trigger_rule == "all_done"
    teardown.execute(context())
    teardown.execute(context())
    assert backend.slice_state(new_slice) is SliceState.DELETED
    TeardownSliceOperator(
        task_id="t2", backend="local", backend_settings=local, slice_handle=None
    ).execute(context())


def test_mapped_jobs_get_distinct_names_and_templated_handles(local):
    handle = provision(local)
    names = set()
    for i in range(2):
        op = job_op(local, json.dumps(handle), "exit 0", task_id="rlax.worker")
        result = run_deferrable(op, context(map_index=i))
        names.add(result["job"]["name"])
    assert names == {"rlax-worker-0", "rlax-worker-1"}


def test_one_slice_takes_its_capacity_identity_and_network(local):
    email = "rl@p.iam.gserviceaccount.com"
    handle = provision(
        local, spot=False, reserved=True, service_account=email, network="rl-net",
        subnetwork="rl-subnet",
    )  # fmt: skip
    spec = SliceSpec.from_dict(handle["spec"])
    assert spec.capacity == "reserved" and spec.service_account == email
    assert (spec.network, spec.subnetwork) == ("rl-net", "rl-subnet")
    assert SliceSpec.from_dict(provision(local, name="other", spot=False)["spec"]).capacity == (
        "on-demand"
    )
    with pytest.raises(AirflowFailException, match="spot or reserved, not both"):
        provision(local, name="both", reserved=True)
    with pytest.raises(AirflowFailException, match="service_account 'rl'"):
        provision(local, name="bad", service_account="rl")


def test_bad_inputs_fail_without_retries(local):
    with pytest.raises(AirflowFailException, match="name"):
        provision(local, name="Not_Valid")
    with pytest.raises(AirflowFailException, match="colour"):
        provision({**local, "colour": "red"})
    handle = provision(local)
    with pytest.raises(AirflowFailException, match="heartbeat_timeout_s"):
        run_deferrable(job_op(local, handle, ["exit", "0"], heartbeat_timeout_s=0), context())


def test_service_watchers_end_and_stop_their_job_once_the_controller_succeeded(local, tmp_path):
    handle = provision(local)
    ckpt = str(tmp_path / "ckpt")
    started = start_jobs(
        "local",
        local,
        handle,
        {"ps": ["sleep", "120"], "controller": ["count", ckpt, "10", "0.05"]},
    )
    assert set(started) == {"ps", "controller"}
    watch = {"started_jobs": started, "done_when": "controller"}
    # the first try of a watcher takes the already running job as is (no second start)
    ps = job_op(local, handle, ["sleep", "120"], task_id="ps", **watch)
    result = run_deferrable(ps, context())
    assert "controller succeeded" in result["message"] and read_counter(ckpt) == 10
    backend = get_backend("local", **local)
    assert backend.job_state(started["ps"]).state is not JobState.RUNNING  # stopped
    result = run_deferrable(
        job_op(local, handle, ["count", ckpt, "10", "0.05"], task_id="controller", **watch),
        context(),
    )
    assert result["exit_code"] == 0
    assert not os.path.exists(started["ps"]["status_dir"] + ".1")  # never restarted


def test_a_watcher_ends_on_the_runs_done_marker_even_with_a_stale_controller_handle(
    local, tmp_path
):
    """After a re-provisioned slice the controller runs under a new handle: the one the run
    started with never succeeds, but the run's DONE marker still ends the watch, and it is
    looked at before the job (the marker's writer stops the jobs right after)."""
    handle = provision(local)
    started = start_jobs("local", local, handle, {"ps": ["sleep", "120"]})
    stale = {**started["ps"], "name": "controller", "status_dir": str(tmp_path / "gone")}
    marker = str(tmp_path / "run" / "DONE")
    op = job_op(
        local, handle, ["sleep", "120"], task_id="ps", done_marker=marker,
        started_jobs={**started, "controller": stale}, done_when="controller",
    )  # fmt: skip
    trigger = None
    try:
        op.execute(context())
    except TaskDeferred as deferred:
        trigger = rebuild(deferred.trigger)
    backend = get_backend("local", **local)
    assert trigger._observe(backend) is None  # running, the controller not done
    os.makedirs(os.path.dirname(marker))
    open(marker, "w").close()
    get_backend("local", **local).stop_job(started["ps"])  # what `finish` does next
    event = trigger._observe(backend)
    assert event["state"] == "DONE" and "DONE exists" in event["message"]
    result = op.execute_complete(context(), event)
    assert result["exit_code"] is None  # a success: the task is not retried
    # a watcher that comes back (rescheduled) after the run completed starts nothing again
    again = op.execute(context())
    assert again["message"] == "the run is complete"
    assert not os.path.exists(started["ps"]["status_dir"] + ".1")


def test_a_job_that_ended_before_its_first_watch_is_reported_not_restarted(local):
    handle = provision(local)
    started = start_jobs("local", local, handle, {"trainer": ["exit", "2"]})
    backend = get_backend("local", **local)
    wait_for(lambda: backend.job_state(started["trainer"]).state is not JobState.RUNNING)
    op = job_op(local, handle, ["exit", "2"], started_jobs=started)
    with pytest.raises(AirflowFailException, match="configuration error"):
        run_deferrable(op, context())
    assert not os.path.exists(started["trainer"]["status_dir"] + ".1")


def test_a_sibling_down_past_the_grace_time_makes_the_watcher_give_way(local):
    handle = provision(local)
    started = start_jobs(
        "local", local, handle, {"ps": ["sleep", "120"], "trainer": ["sleep", "120"]}
    )
    status_dir = started["trainer"]["status_dir"]

    def child_pid():
        try:
            with open(os.path.join(status_dir, "heartbeat")) as f:
                return json.load(f)["pid"]
        except (FileNotFoundError, ValueError):
            return None

    child = wait_for(child_pid)
    os.kill(child, signal.SIGKILL)
    op = job_op(
        local, handle, ["sleep", "120"], task_id="ps", started_jobs=started, sibling_grace_s=0.5
    )
    # its task is still retrying (up_for_retry): give way without using a retry
    with pytest.raises(AirflowRescheduleException):
        run_deferrable(op, context(states={"trainer": "up_for_retry", "worker_0": "failed"}))
    assert get_backend("local", **local).job_state(started["ps"]).state is JobState.RUNNING
    # its task failed for good: nobody restarts it, so the watcher fails and stops its own job
    # instead of holding the run (and its slices) forever
    with pytest.raises(AirflowFailException, match=r"task\(s\) trainer of this run failed"):
        run_deferrable(op, context(states={"trainer": "failed", "ps": "running"}))
    assert get_backend("local", **local).job_state(started["ps"]).state is not JobState.RUNNING
    get_backend("local", **local).teardown(handle)


def test_trigger_reports_an_error_after_repeated_failures(local):
    trigger = JobStateTrigger(
        "local", local, {"name": "broken"}, poll_interval_s=0.01, max_consecutive_errors=2
    )
    event = fire(trigger)
    assert event["state"] == "ERROR"
    with pytest.raises(JobFailedError):
        job_op(local, {}, ["exit", "0"]).execute_complete(context(), event=event)


@pytest.mark.slow
def test_cloud_tpu_preemption_mid_run_reprovisions_and_resumes(tmp_path):
    """Provision (deferred while PROVISIONING) → job → spot preemption → retryable error →
    the retry re-provisions the slice (deferred again) and the job resumes from its checkpoint."""
    ckpt = str(tmp_path / "ckpt")
    with fake_cloud_tpu(str(tmp_path / "logs"), provision_delay_s=0.5) as url:
        settings = fake_backend_settings(
            url, zone="us-east5-a", run_root=str(tmp_path / "control"), entrypoint=ENTRYPOINT
        )
        op = ProvisionSliceOperator(
            task_id="provision",
            backend="cloud_tpu",
            backend_settings=settings,
            name="rlax-r1-main",
            accelerator_type="v6e-8",
            runtime_version="v2-alpha-tpuv6e",
            labels={"rlax-run-id": "r1"},
            poll_interval_s=0.1,
        )
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(context())
        assert isinstance(deferred.value.trigger, SliceReadyTrigger)
        handle = op.execute_complete(context(), event=fire(deferred.value.trigger))

        job = job_op(
            settings,
            handle,
            ["count", ckpt, "25", "0.1"],
            backend="cloud_tpu",
            heartbeat_timeout_s=10,
        )
        with pytest.raises(TaskDeferred) as deferred:
            job.execute(context())
        wait_for(lambda: read_counter(ckpt) >= 3)
        preempt(url, "rlax-r1-main")
        event = fire(deferred.value.trigger)
        assert event["state"] == "PREEMPTED" and "SUSPENDED" in event["message"]
        with pytest.raises(JobPreemptedError):
            job.execute_complete(context(), event=event)
        progress = read_counter(ckpt)

        # the retry: slice SUSPENDED → provisioned again → wait READY → job resumes
        with pytest.raises(TaskDeferred) as deferred:
            job.execute(context())
        assert deferred.value.method_name == "start_on_ready_slice"
        result = run_deferrable_from(job, deferred.value)
        assert result["exit_code"] == 0 and read_counter(ckpt) == 25
        assert result["job"]["slice"]["instance_id"] != handle["instance_id"]
        log = open(os.path.join(result["job"]["status_dir"], "stdout.log")).read()
        assert int(log.split("resumed from step ")[1].split()[0]) >= progress > 0

        TeardownSliceOperator(
            task_id="teardown", backend="cloud_tpu", backend_settings=settings, slice_handle=handle
        ).execute(context())
        backend = get_backend("cloud_tpu", **settings)
        assert backend.slice_state(result["job"]["slice"]) is SliceState.DELETED
        assert backend.list_slices() == []


def run_deferrable_from(op, deferred: TaskDeferred) -> Any:
    method = getattr(op, deferred.method_name)
    kwargs = {"event": fire(deferred.trigger)}
    while True:
        try:
            return method(context(), **kwargs)
        except TaskDeferred as again:
            method, kwargs = getattr(op, again.method_name), {"event": fire(again.trigger)}


def test_a_runs_slices_are_provisioned_together_and_torn_down_together(local):
    from rlax_tasks.airflow import ProvisionSlicesOperator

    slices = [
        {"role": "trainer", "name": "rlax-r1-trainer", "accelerator_type": "cpu"},
        {"role": "workers-0", "name": "rlax-r1-workers-0", "accelerator_type": "cpu"},
    ]
    op = ProvisionSlicesOperator(
        task_id="provision",
        backend="local",
        backend_settings=local,
        slices=slices,
        labels={"rlax-run-id": "r1"},
        poll_interval_s=0.1,
    )
    assert op.multiple_outputs  # each role is an XCom of its own
    out = run_deferrable(op, context())
    assert [out["trainer"]["name"], out["workers-0"]["name"]] == [s["name"] for s in slices]
    assert out["all"] == [out["trainer"], out["workers-0"]]
    assert out["evaluation"] == out["trainer"]  # no slice marked: the first
    marked = [slices[0], {**slices[1], "evaluation": True}]
    again = ProvisionSlicesOperator(
        task_id="provision", backend="local", backend_settings=local, slices=marked,
        labels={"rlax-run-id": "r1"}, poll_interval_s=0.1,
    )  # fmt: skip
    assert run_deferrable(again, context())["evaluation"] == out["workers-0"]  # (idempotent)
    backend = get_backend("local", **local)
    assert {backend.slice_state(h) for h in out["all"]} == {SliceState.READY}
    # a worker on its own slice, on the host its plan names
    job = run_deferrable(
        job_op(local, out["workers-0"], ["exit", "0"], task_id="worker", hosts=[0]), context()
    )
    assert job["job"]["slice"]["name"] == "rlax-r1-workers-0" and job["job"]["hosts"] == [0]
    TeardownSliceOperator(
        task_id="teardown", backend="local", backend_settings=local, slice_handle=out["all"]
    ).execute(context())
    assert {backend.slice_state(h) for h in out["all"]} == {SliceState.DELETED}
