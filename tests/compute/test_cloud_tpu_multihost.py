"""A 2-host slice (v4-16) through the cloud_tpu backend (real google-cloud-tpu REST client)
against the fake API: every host runs the real infra/tpu/startup.sh, which pulls the image and
runs the node agent through the docker stand-in; jobs run on the hosts their spec names. One
slice is provisioned for the module; the last test preempts it and provisions it again."""

import os
import signal

import psutil
import pytest
import requests

from rlax_tasks.compute import JobSpec, JobState, SliceState, get_backend
from tests.compute.helpers import (
    ENTRYPOINT,
    FAKE_IMAGE,
    fake_backend_settings,
    fake_cloud_tpu,
    fake_state,
    host_record,
    preempt,
    read_vars,
    tpu_slice_spec,
    wait_for,
)

pytestmark = pytest.mark.slow

SPEC = tpu_slice_spec("t0", "v4-16", "tpu-ubuntu2204-base")
NODE = "projects/proj/locations/us-central2-b/nodes/t0"


@pytest.fixture(scope="module")
def tpu(tmp_path_factory):
    """(backend, fake URL, handle of a READY v4-16 slice whose 2 agents have published)."""
    tmp_path = tmp_path_factory.mktemp("multihost")
    with fake_cloud_tpu(str(tmp_path / "fake")) as url:
        settings = fake_backend_settings(
            url, run_root=str(tmp_path / "control"), entrypoint=ENTRYPOINT
        )
        backend = get_backend("cloud_tpu", **settings)
        handle = backend.provision(SPEC)
        wait_for(lambda: backend.slice_state(handle) is SliceState.READY)
        wait_for(lambda: host_record(handle.root, 0) and host_record(handle.root, 1), 60)
        yield backend, url, handle
        backend.teardown(handle)


def finished(backend, job):
    status = backend.job_state(job)
    return status if status.state is not JobState.RUNNING else None


def output(job, host):
    sub = "" if host == 0 else f"worker-{host}"
    return read_vars(os.path.join(job.status_dir, sub, "stdout.log"))


def exit_code(job, host):
    from rlax_tasks.compute import jobstatus

    sub = jobstatus.host_status_dir(job.status_dir, host)
    record = jobstatus.read_json(os.path.join(sub, jobstatus.EXIT))
    return None if record is None else record["returncode"]


def beating(job, host):
    sub = "" if host == 0 else f"worker-{host}"
    return os.path.exists(os.path.join(job.status_dir, sub, "heartbeat"))


def addresses(backend):
    """The node's host addresses, in host order (its networkEndpoints)."""
    return [e.ip_address for e in backend.client.get_node(name=NODE).network_endpoints]


def test_every_host_runs_the_startup_script_and_its_agent(tpu):
    backend, url, handle = tpu
    ips = addresses(backend)
    # every host has its own address, as TPU VMs do (loopback ones: bindable with no setup)
    assert len(ips) == len(set(ips)) == 2 and "127.0.0.1" not in ips
    assert all(ip.startswith("127.") and ip.split(".")[3] not in ("0", "255") for ip in ips)
    hosts = fake_state(url)["hosts"][NODE]
    assert [h["host"] for h in hosts] == [0, 1]
    assert [h["address"] for h in hosts] == ips
    google = {"Metadata-Flavor": "Google"}
    for k, host in enumerate(hosts):
        assert host["startup"]["returncode"] == 0  # the real startup.sh, to its end
        agent = host["containers"]["rlax-agent"]
        assert agent["running"] and agent["restarts"] == 0
        assert agent["command"][:5] == ["tini", "--", "python", "-m", "rlax_tasks.compute.agent"]
        flags = dict(zip(agent["command"][5::2], agent["command"][6::2], strict=True))
        assert flags["--worker"] == str(k) and flags["--slice-root"] == handle.root
        assert flags["--address"] == ips[k]  # startup.sh read it from the host's metadata
        md = f"{url}/fake/metadata/{NODE}/hosts/{k}/computeMetadata/v1/instance"
        ip = requests.get(f"{md}/network-interfaces/0/ip", headers=google, timeout=5).text
        assert ip == ips[k]
        assert host_record(handle.root, k) == {
            "address": ips[k],
            "worker": k,
            "time": host_record(handle.root, k)["time"],
        }
    # each host's metadata server, as the real one: the header is required
    md = f"{url}/fake/metadata/{NODE}/hosts/1/computeMetadata/v1/instance"
    assert requests.get(f"{md}/attributes/agent-worker-number", timeout=5).status_code == 403
    assert requests.get(f"{md}/network-interfaces/0/ip", timeout=5).status_code == 403
    assert requests.get(f"{md}/attributes/agent-worker-number", headers=google).text == "1"
    assert requests.get(f"{md}/attributes/rlax-image", headers=google).text == FAKE_IMAGE


def test_a_group_job_runs_on_both_hosts_and_a_default_job_on_host_0(tpu):
    backend, _, handle = tpu
    group = backend.start_job(handle, JobSpec(name="train", argv=["group", "0"], hosts=(0, 1)))
    status = wait_for(lambda: finished(backend, group))
    assert status.state is JobState.SUCCEEDED and status.message == "exit code 0 on all 2 hosts"
    first, second = output(group, 0), output(group, 1)
    assert (first["RLAX_PROCESS_ID"], second["RLAX_PROCESS_ID"]) == ("0", "1")
    assert first["RLAX_NUM_PROCESSES"] == second["RLAX_NUM_PROCESSES"] == "2"
    assert first["RLAX_COORDINATOR_ADDRESS"] == second["RLAX_COORDINATOR_ADDRESS"]
    ips = addresses(backend)
    assert first["RLAX_COORDINATOR_ADDRESS"] == f"{ips[0]}:8482"  # on host 0
    assert (first["RLAX_WORKER_ID"], second["RLAX_WORKER_ID"]) == ("0", "1")
    # each host's own address, the one it published
    assert [first["RLAX_HOST_ADDRESS"], second["RLAX_HOST_ADDRESS"]] == ips
    assert ips[0] != ips[1]
    assert [host_record(handle.root, k)["address"] for k in (0, 1)] == ips

    single = backend.start_job(handle, JobSpec(name="ps", argv=["group", "0"]))
    # submitted after `single`: once host 1 ran it, host 1's agent has seen `single` too
    later = backend.start_job(handle, JobSpec(name="probe", argv=["exit", "0"], hosts=(1,)))
    assert wait_for(lambda: finished(backend, later)).state is JobState.SUCCEEDED
    assert wait_for(lambda: finished(backend, single)).state is JobState.SUCCEEDED
    out = output(single, 0)
    assert out["RLAX_WORKER_ID"] == "0" and out["RLAX_NUM_PROCESSES"] == ""
    assert not os.path.exists(os.path.join(single.status_dir, "worker-1"))
    assert not os.path.exists(os.path.join(later.status_dir, "runner.json"))  # not on host 0


def stderr(job, host):
    sub = "" if host == 0 else f"worker-{host}"
    with open(os.path.join(job.status_dir, sub, "stderr.log")) as f:
        return f.read()


def test_the_fake_libtpu_refuses_what_libtpu_would(tpu):
    """Processes that load the TPU runtime (JAX_PLATFORMS unset, as on a TPU VM): one on each
    host of the 2-host slice join it; one on host 0 alone waits for host 1, then fails;
    inconsistent process bounds fail at once; the variables the product's placement gives a
    process of some chips of a host pass."""
    from rlax_tasks.config import load_config
    from rlax_tasks.plan.placement import job_env

    backend, _, handle = tpu

    def run(name, hosts, env=None):
        job = backend.start_job(
            handle, JobSpec(name=name, argv=["tpu"], hosts=hosts, env=env or {})
        )
        return job, wait_for(lambda: finished(backend, job), timeout_s=60)

    whole, status = run("tpu-whole", (0, 1))
    assert status.state is JobState.SUCCEEDED, status.message
    for host in (0, 1):
        assert f"fake libtpu: host {host} of v4-16: the slice's 2 hosts joined" in stderr(
            whole, host
        )
        assert "4 TPU device(s), on the CPU" in stderr(whole, host)
        # JAX's TPU backend: the host's 4 chips (the CPU stands in for them)
        assert (output(whole, host)["platform"], output(whole, host)["devices"]) == ("tpu", "4")

    _, status = run("tpu-partial", (0,), {"RLAX_FAKE_LIBTPU_WAIT_S": "5"})  # (not 60 s)
    assert status.state is JobState.FAILED
    assert "TPU initialization failed: host 0 of v4-16 waited 5 s" in status.message
    assert "host(s) 1 never started the TPU runtime" in status.message

    bounds = {"TPU_PROCESS_BOUNDS": "1,1,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1"}
    _, status = run("tpu-bounds", (0,), {**bounds, "TPU_VISIBLE_CHIPS": "0,1"})
    assert status.state is JobState.FAILED
    assert "TPU_VISIBLE_CHIPS=0,1 names 2 chip(s) but TPU_CHIPS_PER_PROCESS_BOUNDS=2,2,1 is 4" in (
        status.message
    )
    _, status = run("tpu-two", (0,), {**bounds, "TPU_PROCESS_BOUNDS": "1,2,1"})
    assert status.state is JobState.FAILED and "need 8 chips; this host has 4" in status.message

    # a worker of two chips beside the trainer on one host, as rlax_tasks.plan.placement says
    overrides = {
        "placement.platform": "tpu",
        "placement.mode": "disaggregated",
        "placement.trainer": [0, 1],
        "placement.workers": [[2, 3]],
    }
    env = job_env(load_config("tiny-arith", overrides), "worker-0")
    some, status = run("tpu-some", (1,), env)
    assert status.state is JobState.SUCCEEDED, status.message
    assert "fake libtpu: host 1 of v4-16: a slice of its chips 2,3 as process 0 of 1" in stderr(
        some, 1
    )
    assert (output(some, 1)["platform"], output(some, 1)["devices"]) == ("tpu", "2")


@pytest.mark.parametrize(
    ("how", "state", "why"),
    [
        ("killed", JobState.PREEMPTED, "host 1: killed by SIGKILL"),
        ("exit 3", JobState.FAILED, "host 1: exit code 3"),
        ("exit 2", JobState.FAILED, "host 1: configuration error"),
    ],
)
def test_one_host_ending_ends_the_job_on_every_host(tpu, how, state, why):
    backend, _, handle = tpu
    argv = ["group", "60"] if how == "killed" else ["group", "60", "1", how.split()[1]]
    job = backend.start_job(handle, JobSpec(name="train", argv=argv, hosts=(0, 1)))
    wait_for(lambda: beating(job, 0) and (beating(job, 1) or exit_code(job, 1) is not None))
    if how == "killed":
        pid = wait_for(lambda: _heartbeat_pid(job, 1))
        os.kill(pid, signal.SIGKILL)
    status = wait_for(lambda: finished(backend, job))
    assert status.state is state and status.message.startswith(why)
    assert status.is_config_error is (how == "exit 2")
    # host 0's agent sees host 1's end and stops its own process of the broken group
    wait_for(lambda: exit_code(job, 0) is not None, timeout_s=30)
    assert exit_code(job, 0) == -signal.SIGTERM
    assert backend.job_state(job).message.startswith(why)  # still the first host to end


def _heartbeat_pid(job, host):
    from rlax_tasks.compute import jobstatus

    sub = jobstatus.host_status_dir(job.status_dir, host)
    return (jobstatus.read_json(os.path.join(sub, jobstatus.HEARTBEAT)) or {}).get("pid")


def test_stop_then_preemption_kill_every_host_and_the_new_vms_have_new_addresses(tpu):
    backend, url, handle = tpu
    old = addresses(backend)
    stopped = backend.start_job(handle, JobSpec(name="a", argv=["group", "60"], hosts=(0, 1)))
    wait_for(lambda: beating(stopped, 0) and beating(stopped, 1))
    backend.stop_job(stopped)
    status = wait_for(lambda: finished(backend, stopped))
    assert status.state is JobState.FAILED and "stopped by request" in status.message
    wait_for(lambda: exit_code(stopped, 0) is not None and exit_code(stopped, 1) is not None)

    job = backend.start_job(handle, JobSpec(name="b", argv=["group", "60"], hosts=(0, 1)))
    wait_for(lambda: beating(job, 0) and beating(job, 1))
    programs = [_heartbeat_pid(job, 0), _heartbeat_pid(job, 1)]
    before = {p for h in fake_state(url)["hosts"][NODE] for p in h["pids"]}
    assert set(programs) <= before  # the jobs are processes of the hosts, agents too
    preempt(url, "t0")
    status = wait_for(lambda: finished(backend, job))
    assert status.state is JobState.PREEMPTED and "SUSPENDED by SERVICE" in status.message
    assert not [p for p in before if _alive(p)]  # SIGKILLed at once, on both hosts
    assert [h["pids"] for h in fake_state(url)["hosts"][NODE]] == [[], []]
    assert fake_state(url)["agents"] == {}

    # re-provisioned: new VMs with new addresses, published again for the jobs to use
    again = backend.provision(handle.slice_spec)
    wait_for(lambda: backend.slice_state(again) is SliceState.READY)
    new = addresses(backend)
    assert len(set(new)) == 2 and not set(new) & set(old)
    assert [h["address"] for h in fake_state(url)["hosts"][NODE]] == new
    wait_for(lambda: host_record(again.root, 0) and host_record(again.root, 1), 60)
    assert [host_record(again.root, k)["address"] for k in (0, 1)] == new
    group = backend.start_job(again, JobSpec(name="c", argv=["group", "0"], hosts=(0, 1)))
    assert wait_for(lambda: finished(backend, group)).state is JobState.SUCCEEDED
    first, second = output(group, 0), output(group, 1)
    assert [first["RLAX_HOST_ADDRESS"], second["RLAX_HOST_ADDRESS"]] == new
    assert first["RLAX_COORDINATOR_ADDRESS"] == second["RLAX_COORDINATOR_ADDRESS"]
    assert first["RLAX_COORDINATOR_ADDRESS"] == f"{new[0]}:8482"
    backend.teardown(again)


def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
