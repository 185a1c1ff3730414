"""The state of a job on several hosts, read from its hosts' status directories."""

import os

from rlax_tasks.compute import JobState
from rlax_tasks.compute.jobstatus import (
    EXIT,
    HEARTBEAT,
    RUNNER,
    STOP,
    host_status_dir,
    read_group_status,
    read_job_status,
    write_json,
)

NOW = 1000.0


def running(job_dir, host):
    d = host_status_dir(str(job_dir), host)
    # a runner on another machine: only its files tell how it does
    write_json(
        os.path.join(d, RUNNER),
        {"pid": 1, "create_time": 0, "host": "elsewhere", "started_at": NOW - 5},
    )
    write_json(os.path.join(d, HEARTBEAT), {"time": NOW - 1})


def exited(job_dir, host, returncode, at):
    running(job_dir, host)
    write_json(
        os.path.join(host_status_dir(str(job_dir), host), EXIT),
        {"returncode": returncode, "finished_at": at},
    )


def state(job_dir, hosts=(0, 1)):
    return read_group_status(str(job_dir), hosts, 30.0, NOW - 10, now=NOW)


def test_host_k_writes_a_worker_directory(tmp_path):
    assert host_status_dir("gs://b/jobs/j.1", 0) == "gs://b/jobs/j.1"
    assert host_status_dir("gs://b/jobs/j.1", 3) == "gs://b/jobs/j.1/worker-3"


def test_running_until_every_host_succeeded(tmp_path):
    running(tmp_path, 0)
    running(tmp_path, 1)
    assert state(tmp_path).state is JobState.RUNNING
    exited(tmp_path, 0, 0, NOW - 2)  # one host done: the group is not
    status = state(tmp_path)
    assert status.state is JobState.RUNNING and "1 of 2" in status.message
    exited(tmp_path, 1, 0, NOW - 1)
    status = state(tmp_path)
    assert status.state is JobState.SUCCEEDED and status.exit_code == 0


def test_one_host_failing_fails_the_job_at_once(tmp_path):
    running(tmp_path, 0)
    exited(tmp_path, 1, 3, NOW - 2)
    status = state(tmp_path)
    assert status.state is JobState.FAILED and status.exit_code == 3
    assert status.message.startswith("host 1: exit code 3")


def test_the_first_host_to_end_is_the_cause(tmp_path):
    exited(tmp_path, 1, -9, NOW - 8)  # killed (a preempted host)...
    exited(tmp_path, 0, 1, NOW - 3)  # ...then its peer errors out without it
    status = state(tmp_path)
    assert status.state is JobState.PREEMPTED and status.message.startswith("host 1: killed")
    assert "1 other host(s) ended too" in status.message


def test_a_configuration_error_on_any_host_wins(tmp_path):
    exited(tmp_path, 0, -15, NOW - 8)
    exited(tmp_path, 1, 2, NOW - 3)
    status = state(tmp_path)
    assert status.is_config_error and status.message.startswith("host 1:")


def test_a_host_that_never_started_is_lost(tmp_path):
    running(tmp_path, 0)  # host 1 wrote nothing, and the job was submitted long ago
    status = read_group_status(str(tmp_path), (0, 1), 30.0, NOW - 60, now=NOW)
    assert status.state is JobState.PREEMPTED
    assert status.message.startswith("host 1: no heartbeat") and "never started" in status.message


def test_a_stop_applies_to_every_host(tmp_path):
    write_json(os.path.join(tmp_path, STOP), {"time": NOW})
    exited(tmp_path, 0, -15, NOW - 2)
    exited(tmp_path, 1, -15, NOW - 2)
    status = state(tmp_path)
    assert status.state is JobState.FAILED and "stopped by request" in status.message


def test_a_job_on_host_0_alone_reads_as_before(tmp_path):
    exited(tmp_path, 0, 1, NOW - 2)
    assert state(tmp_path, (0,)) == read_job_status(str(tmp_path), 30.0, NOW - 10, now=NOW)
    assert state(tmp_path, (0,)).message == "exit code 1"
