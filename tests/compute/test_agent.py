"""The node agent on one host of a slice: which jobs it starts, with which process-group
variables, and when it stops a job's process (driven pass by pass through ``poll_once``)."""

import logging
import os
import signal

import pytest

from rlax_tasks.compute import jobstatus
from rlax_tasks.compute.agent import NodeAgent
from tests.compute.helpers import ENTRYPOINT, host_record, read_vars, wait_for


@pytest.fixture
def agents():
    """make(slice_root, worker, address, **kw) → a NodeAgent; kills its jobs afterwards."""
    made = []

    def make(root, worker, address, **kw):
        agent = NodeAgent(str(root), ENTRYPOINT, worker, stop_grace_s=2.0, address=address, **kw)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        for proc in agent.running.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def submit(root, name, argv, hosts=None, env=None):
    job = {"name": name.split(".")[0], "argv": argv, "env": env or {}}
    if hosts is not None:
        job["hosts"] = hosts
    job_dir = os.path.join(root, "jobs", name)
    jobstatus.write_json(
        os.path.join(job_dir, jobstatus.SPEC), {"job": job, "heartbeat_interval_s": 0.2}
    )
    return job_dir


def exit_code(status_dir):
    ex = jobstatus.read_json(os.path.join(status_dir, jobstatus.EXIT))
    return None if ex is None else ex["returncode"]


def test_a_group_job_waits_for_its_first_host_then_gets_the_group_variables(
    tmp_path, agents, caplog
):
    caplog.set_level(logging.INFO, logger="rlax_tasks.compute.agent")
    agent = agents(tmp_path, 1, "10.0.0.2")
    job_dir = submit(tmp_path, "g.1", ["group", "0"], [0, 1], {"RLAX_COORDINATOR_PORT": "9001"})
    mine = jobstatus.host_status_dir(job_dir, 1)
    agent.poll_once()
    assert host_record(str(tmp_path), 1)["address"] == "10.0.0.2"
    assert not os.path.exists(os.path.join(mine, jobstatus.RUNNER))  # host 0 unknown yet
    assert "waits for host 0 to publish its address" in caplog.text

    jobstatus.write_json(jobstatus.host_record_path(str(tmp_path), 0), {"address": "10.0.0.1"})
    agent.poll_once()
    wait_for(lambda: exit_code(mine) is not None)
    assert exit_code(mine) == 0
    assert read_vars(os.path.join(mine, jobstatus.STDOUT)) == {
        "RLAX_WORKER_ID": "1",
        "RLAX_HOST_ADDRESS": "10.0.0.2",
        "RLAX_PROCESS_ID": "1",
        "RLAX_NUM_PROCESSES": "2",
        "RLAX_COORDINATOR_ADDRESS": "10.0.0.1:9001",
    }
    assert not os.path.exists(os.path.join(job_dir, jobstatus.RUNNER))  # host 0's part


def test_jobs_run_only_on_their_hosts_and_the_process_id_follows_their_order(tmp_path, agents):
    agent = agents(tmp_path, 1, "10.0.0.2")
    default = submit(tmp_path, "a.1", ["group", "0"])  # no hosts: host 0 only
    reordered = submit(tmp_path, "b.1", ["group", "0"], [1, 0])  # host 1 leads
    agent.poll_once()
    mine = jobstatus.host_status_dir(reordered, 1)
    wait_for(lambda: exit_code(mine) is not None)
    out = read_vars(os.path.join(mine, jobstatus.STDOUT))
    assert out["RLAX_PROCESS_ID"] == "0" and out["RLAX_COORDINATOR_ADDRESS"] == "10.0.0.2:8482"
    agent.poll_once()
    assert os.listdir(default) == [jobstatus.SPEC]  # never started on host 1


def test_it_gives_up_on_a_first_host_that_never_publishes(tmp_path, agents, caplog):
    agent = agents(tmp_path, 1, "10.0.0.2", address_wait_s=0.0)
    submit(tmp_path, "g.1", ["group", "0"], [2, 1])
    agent.poll_once()
    wait_for(lambda: agent.poll_once() or "g.1" in agent.seen, timeout_s=5)
    assert "host 2 has not published its address" in caplog.text
    assert not os.path.exists(os.path.join(tmp_path, "jobs", "g.1", "worker-1", "runner.json"))


def test_the_first_host_stops_its_process_when_another_host_failed(tmp_path, agents):
    agent = agents(tmp_path, 0, "10.0.0.1", peer_check_s=0.0)
    job_dir = submit(tmp_path, "g.1", ["group", "60"], [0, 1])
    agent.poll_once()
    wait_for(lambda: os.path.exists(os.path.join(job_dir, jobstatus.HEARTBEAT)))
    agent.poll_once()
    assert exit_code(job_dir) is None  # host 1 still fine
    peer = jobstatus.host_status_dir(job_dir, 1)
    jobstatus.write_json(os.path.join(peer, jobstatus.EXIT), {"returncode": 3, "finished_at": 1})
    wait_for(lambda: agent.poll_once() or exit_code(job_dir) is not None)
    assert exit_code(job_dir) == -signal.SIGTERM


def test_a_newer_attempt_stops_the_older_one(tmp_path, agents):
    agent = agents(tmp_path, 0, "10.0.0.1")
    old = submit(tmp_path, "t.1", ["sleep", "60"])
    agent.poll_once()
    wait_for(lambda: os.path.exists(os.path.join(old, jobstatus.HEARTBEAT)))
    new = submit(tmp_path, "t.2", ["exit", "0"])
    wait_for(lambda: agent.poll_once() or exit_code(old) is not None)
    assert exit_code(old) == -signal.SIGTERM
    wait_for(lambda: agent.poll_once() or exit_code(new) is not None)
    assert exit_code(new) == 0
