"""The local backend: slices are directories, jobs detached runner processes."""

import json
import os
import signal
import sys

import pytest

from rlax_tasks.compute import JobSpec, JobState, SliceSpec, SliceState, get_backend
from rlax_tasks.process.host_malloc import is_glibc
from tests.compute.helpers import ENTRYPOINT, wait_for


@pytest.fixture
def backend(tmp_path):
    return get_backend("local", run_root=str(tmp_path), entrypoint=ENTRYPOINT, stop_grace_s=2.0)


@pytest.fixture
def slice_(backend):
    handle = backend.provision(SliceSpec(name="s0", labels={"rlax-run-id": "r1"}))
    yield handle
    backend.teardown(handle)


def finished(backend, job):
    status = backend.job_state(job)
    return status if status.state is not JobState.RUNNING else None


def test_provision_is_idempotent_and_listed(backend, tmp_path):
    spec = SliceSpec(name="s0", labels={"rlax-run-id": "r1"})
    h = backend.provision(spec)
    assert h.root == os.path.join(str(tmp_path), "r1", "slices", "s0")
    assert backend.provision(spec) == h
    assert backend.slice_state(h) is SliceState.READY
    other = backend.provision(SliceSpec(name="s1", labels={"rlax-run-id": "r2"}))
    assert [s.name for s in backend.list_slices({"rlax-run-id": "r1"})] == ["s0"]
    assert {s.name for s in backend.list_slices({"rlax-managed": "true"})} == {"s0", "s1"}
    backend.teardown(other)
    backend.teardown(other)  # idempotent
    assert backend.slice_state(other) is SliceState.DELETED
    assert [s.name for s in backend.list_slices()] == ["s0"]
    # re-provisioning a deleted slice creates a new instance; old handles see it as DELETED
    again = backend.provision(SliceSpec(name="s1", labels={"rlax-run-id": "r2"}))
    assert again.instance_id != other.instance_id
    assert backend.slice_state(other) is SliceState.DELETED


def test_job_succeeds_with_logs_and_env(backend, slice_, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    job = backend.start_job(slice_, JobSpec(name="ok", argv=["count", ckpt, "2", "0.01"]))
    status = wait_for(lambda: finished(backend, job))
    assert status.state is JobState.SUCCEEDED and status.exit_code == 0
    with open(os.path.join(job.status_dir, "stdout.log")) as fh:
        assert "resumed from step 0" in fh.read()
    spec = json.load(open(os.path.join(job.status_dir, "spec.json")))
    assert spec["command"] == [*ENTRYPOINT, "count", ckpt, "2", "0.01"]
    env_job = backend.start_job(
        slice_, JobSpec(name="env", argv=["env", "RLAX_X"], env={"RLAX_X": "42"})
    )
    assert wait_for(lambda: finished(backend, env_job)).state is JobState.SUCCEEDED
    with open(os.path.join(env_job.status_dir, "stdout.log")) as fh:
        assert fh.read().strip() == "RLAX_X=42"


@pytest.mark.skipif(not is_glibc(), reason="glibc only")
def test_a_job_computing_on_the_host_starts_with_its_heap_on_huge_pages(backend, slice_):
    """The runner sets glibc's huge-page tunable for the command (process.host_malloc),
    beside the tunables the job's environment already has; an accelerator job keeps its
    environment."""
    env = {"JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": "glibc.malloc.arena_max=1"}
    cpu = backend.start_job(slice_, JobSpec(name="cpu", argv=["env", "GLIBC_TUNABLES"], env=env))
    tpu = backend.start_job(
        slice_,
        JobSpec(name="tpu", argv=["env", "GLIBC_TUNABLES"], env={**env, "JAX_PLATFORMS": "tpu"}),
    )
    for job, expected in [
        (cpu, "glibc.malloc.arena_max=1:glibc.malloc.hugetlb=1"),
        (tpu, "glibc.malloc.arena_max=1"),
    ]:
        assert wait_for(lambda job=job: finished(backend, job)).state is JobState.SUCCEEDED
        with open(os.path.join(job.status_dir, "stdout.log")) as fh:
            assert fh.read().strip() == f"GLIBC_TUNABLES={expected}"


def test_exit_code_2_is_a_configuration_error(backend, slice_):
    job = backend.start_job(slice_, JobSpec(name="bad", argv=["exit", "2"]))
    status = wait_for(lambda: finished(backend, job))
    assert status.state is JobState.FAILED and status.is_config_error
    assert "configuration error" in status.message and "exiting with 2" in status.message
    other = backend.start_job(slice_, JobSpec(name="crash", argv=["exit", "3"]))
    status = wait_for(lambda: finished(backend, other))
    assert status.state is JobState.FAILED and not status.is_config_error


@pytest.mark.slow
def test_real_rlax_cli_user_error_is_a_configuration_error(tmp_path):
    """The default entrypoint is `python -m rlax_tasks.cli`: a bad flag value exits 2."""
    backend = get_backend("local", run_root=str(tmp_path))
    handle = backend.provision(SliceSpec(name="cli"))
    argv = ["run", "--steps", "0", "--run-root", str(tmp_path / "r")]
    job = backend.start_job(handle, JobSpec(name="run", argv=argv))
    status = wait_for(lambda: finished(backend, job), timeout_s=120)
    assert status.is_config_error, status
    assert "--steps must be a positive number" in status.message


def test_sigkill_of_the_job_is_preemption(backend, slice_):
    job = backend.start_job(slice_, JobSpec(name="victim", argv=["sleep", "60"]))
    beat = os.path.join(job.status_dir, "heartbeat")
    wait_for(lambda: os.path.exists(beat))
    assert backend.job_state(job).state is JobState.RUNNING
    os.kill(json.load(open(beat))["pid"], signal.SIGKILL)
    status = wait_for(lambda: finished(backend, job))
    assert status.state is JobState.PREEMPTED and "SIGKILL" in status.message


def test_sigkill_of_the_runner_is_preemption(backend, slice_):
    """kill -9 of the whole process group (a lost host): no exit code is ever written."""
    job = backend.start_job(slice_, JobSpec(name="host", argv=["sleep", "60"]))
    runner = os.path.join(job.status_dir, "runner.json")
    wait_for(lambda: os.path.exists(os.path.join(job.status_dir, "heartbeat")))
    os.killpg(json.load(open(runner))["pid"], signal.SIGKILL)
    status = wait_for(lambda: finished(backend, job))
    assert status.state is JobState.PREEMPTED
    assert not os.path.exists(os.path.join(job.status_dir, "exit.json"))


def test_missing_heartbeat_is_preemption(backend, slice_):
    """A hung host: processes exist but the heartbeat stops (SIGSTOP the runner)."""
    job = backend.start_job(
        slice_, JobSpec(name="hung", argv=["sleep", "60"], heartbeat_timeout_s=1.0)
    )
    beat = os.path.join(job.status_dir, "heartbeat")
    wait_for(lambda: os.path.exists(beat))
    runner_pid = json.load(open(os.path.join(job.status_dir, "runner.json")))["pid"]
    os.kill(runner_pid, signal.SIGSTOP)
    try:
        status = wait_for(lambda: finished(backend, job), timeout_s=15)
        assert status.state is JobState.PREEMPTED and "no heartbeat" in status.message
    finally:
        backend.stop_job(job)  # SIGCONT + SIGTERM + SIGKILL: nothing is left behind
    state = wait_for(lambda: finished(backend, job))
    assert state.state is JobState.FAILED and "stopped" in state.message


def test_start_is_idempotent_while_running_and_a_retry_archives(backend, slice_):
    spec = JobSpec(name="svc", argv=["sleep", "60"])
    first = backend.start_job(slice_, spec)
    assert backend.start_job(slice_, spec) == first  # still running: the same job
    backend.stop_job(first)
    assert wait_for(lambda: finished(backend, first)).state is JobState.FAILED
    retry = backend.start_job(slice_, JobSpec(name="svc", argv=["exit", "0"]))
    assert wait_for(lambda: finished(backend, retry)).state is JobState.SUCCEEDED
    assert os.path.exists(first.status_dir + ".1")  # the first attempt, kept for its logs


def test_teardown_stops_running_jobs(backend, tmp_path):
    handle = backend.provision(SliceSpec(name="gone"))
    job = backend.start_job(handle, JobSpec(name="long", argv=["sleep", "60"]))
    wait_for(lambda: os.path.exists(os.path.join(job.status_dir, "heartbeat")))
    backend.teardown(handle)
    assert backend.slice_state(handle) is SliceState.DELETED
    status = wait_for(lambda: finished(backend, job))
    assert status.state is JobState.FAILED
    pid = json.load(open(os.path.join(job.status_dir, "runner.json")))["pid"]
    wait_for(lambda: not _group_alive(pid))
    with pytest.raises(RuntimeError, match="DELETED"):
        backend.start_job(handle, JobSpec(name="late", argv=["exit", "0"]))


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def test_job_state_is_readable_from_another_process(backend, slice_):
    job = backend.start_job(slice_, JobSpec(name="shared", argv=["exit", "0"]))
    wait_for(lambda: finished(backend, job))
    code = (
        "import json,sys; from rlax_tasks.compute import get_backend; "
        f"b = get_backend('local', run_root={backend.run_root!r}); "
        "print(b.job_state(json.loads(sys.argv[1])).state.value)"
    )
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(job.to_dict())],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "SUCCEEDED"


def test_a_local_slice_has_one_host(backend, slice_):
    with pytest.raises(ValueError, match=r"hosts=\[0, 1\] but a local slice has one host"):
        backend.start_job(slice_, JobSpec(name="two", argv=["exit", "0"], hosts=(0, 1)))
