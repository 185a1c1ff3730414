"""The ray backend on a real local Ray cluster: a head node and two worker nodes with a (fake)
GPU each; slices are placement groups, jobs runner processes in actors on their bundles."""

import contextlib
import json
import os
import subprocess
import sys

import psutil
import pytest
import ray
from ray.cluster_utils import Cluster

from rlax_tasks.compute import (
    COORDINATOR_ADDRESS_ENV,
    HOST_ADDRESS_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    WORKER_ID_ENV,
    JobSpec,
    JobState,
    SliceSpec,
    SliceState,
    get_backend,
)
from rlax_tasks.compute.jobstatus import host_status_dir
from rlax_tasks.compute.ray_cluster import ACTOR_PREFIX, PG_PREFIX, RayBackendError
from rlax_tasks.compute.types import DEFAULT_COORDINATOR_PORT
from tests.compute.helpers import ENTRYPOINT, REPO, read_vars, wait_for

pytestmark = pytest.mark.slow

MB = 1024 * 1024
NAMESPACE = "rlax-test"
RUN = {"rlax-run-id": "r1"}
# a lost node is noticed within about two seconds (Ray's default health check takes ~30 s)
HEALTH_CHECK = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
SLOW_S = 90.0  # the longest wait for something that takes a few seconds on an idle machine


def add_gpu_node(cluster):
    return cluster.add_node(num_cpus=2, num_gpus=1, object_store_memory=80 * MB)


@pytest.fixture(scope="module")
def cluster():
    """A head node (1 CPU, no GPU) and two worker nodes (2 CPUs, 1 GPU each)."""
    head = {"num_cpus": 1, "object_store_memory": 80 * MB, "_system_config": HEALTH_CHECK}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        add_gpu_node(cluster)
        add_gpu_node(cluster)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def backend(cluster, tmp_path):
    """The backend on a run root of its own; what a failed test left on it is torn down."""
    backend = get_backend(
        "ray",
        run_root=str(tmp_path / "runs"),
        address=cluster.address,
        namespace=NAMESPACE,
        entrypoint=ENTRYPOINT,
        stop_grace_s=2.0,
    )
    yield backend
    for handle in backend.list_slices():
        backend.teardown(handle)


def finished(backend, job):
    status = backend.job_state(job)
    return status if status.state is not JobState.RUNNING else None


def ended(backend, job):
    """The job's status once it is no longer RUNNING (generous: each host's actor is a new
    process, slow to start on a loaded machine)."""
    return wait_for(lambda: finished(backend, job), timeout_s=SLOW_S)


def ready(backend, spec):
    handle = backend.provision(spec)
    wait_for(lambda: backend.slice_state(handle) is SliceState.READY, timeout_s=SLOW_S)
    return handle


def nodes_of(handle):
    """{host: node id} of a slice's bundles, as Ray placed them."""
    return ray.util.placement_group_table()[handle.instance_id]["bundles_to_node_id"]


def node_ips():
    return {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_nothing_left(handle):
    """The slice's placement group is removed and no actor of it (or of any job) lives."""
    assert ray.util.placement_group_table()[handle.instance_id]["state"] == "REMOVED"
    live = [
        row
        for row in ray.util.placement_group_table().values()
        if row["name"].startswith(PG_PREFIX) and row["state"] != "REMOVED"
    ]
    assert live == []
    actors = ray.util.list_named_actors(all_namespaces=True)
    assert [a for a in actors if a["name"].startswith(ACTOR_PREFIX)] == []


def test_a_two_host_job_runs_on_two_nodes_with_its_process_group(backend):
    spec = SliceSpec(name="pair", accelerator_type="2xgpu-1", labels=RUN)
    handle = ready(backend, spec)
    assert backend.provision(spec) == handle  # idempotent by name
    row = ray.util.placement_group_table()[handle.instance_id]
    assert row["strategy"] == "STRICT_SPREAD"
    assert row["bundles"] == {0: {"CPU": 1.0, "GPU": 1.0}, 1: {"CPU": 1.0, "GPU": 1.0}}
    node = nodes_of(handle)
    assert node[0] != node[1]
    assert [h.name for h in backend.list_slices(RUN)] == ["pair"]
    assert backend.list_slices({"rlax-run-id": "r2"}) == []

    env = {"RLAX_COORDINATOR_PORT": "9123"}
    spec = JobSpec(name="group", argv=["group", "0"], hosts=(0, 1), env=env)
    job = backend.start_job(handle, spec)
    status = ended(backend, job)
    assert status.state is JobState.SUCCEEDED and status.exit_code == 0, status
    ip = node_ips()
    for host in (0, 1):
        seen = read_vars(os.path.join(host_status_dir(job.status_dir, host), "stdout.log"))
        assert seen == {
            WORKER_ID_ENV: str(host),
            HOST_ADDRESS_ENV: ip[node[host]],
            PROCESS_ID_ENV: str(host),
            NUM_PROCESSES_ENV: "2",
            COORDINATOR_ADDRESS_ENV: f"{ip[node[0]]}:9123",
        }
    # another process (an Airflow trigger) connects on its own and reads the same state
    code = (
        "import json, sys; from rlax_tasks.compute import get_backend; "
        f"b = get_backend('ray', run_root={backend.run_root!r}, address={backend.address!r}, "
        f"namespace={NAMESPACE!r}); print(b.job_state(json.loads(sys.argv[1])).state.value)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(job.to_dict())],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    assert out.stdout.strip() == "SUCCEEDED"
    # without a port of its own the coordinator takes one free on its node, not the fixed
    # default another group there (another run's) may listen on: both hosts are told the same
    job = backend.start_job(handle, JobSpec(name="group2", argv=["group", "0"], hosts=(0, 1)))
    assert ended(backend, job).state is JobState.SUCCEEDED
    addresses = {
        read_vars(os.path.join(host_status_dir(job.status_dir, h), "stdout.log"))[
            COORDINATOR_ADDRESS_ENV
        ]
        for h in (0, 1)
    }
    (address,) = addresses
    host, port = address.rsplit(":", 1)
    assert host == ip[node[0]] and int(port) != DEFAULT_COORDINATOR_PORT

    backend.teardown(handle)
    backend.teardown(handle)  # idempotent
    assert backend.slice_state(handle) is SliceState.DELETED
    assert backend.list_slices(RUN) == []
    assert_nothing_left(handle)


def test_exit_codes_stops_and_retries(backend):
    handle = ready(backend, SliceSpec(name="one", accelerator_type="cpu", labels=RUN))
    ok = backend.start_job(handle, JobSpec(name="ok", argv=["exit", "0"]))
    bad = backend.start_job(handle, JobSpec(name="bad", argv=["exit", "1"]))
    assert ended(backend, ok).state is JobState.SUCCEEDED
    status = ended(backend, bad)
    assert status.state is JobState.FAILED and status.exit_code == 1
    assert not status.is_config_error and "exiting with 1" in status.message

    spec = JobSpec(name="long", argv=["sleep", "60"])
    long = backend.start_job(handle, spec)
    assert backend.start_job(handle, spec) == long  # still running: the same job
    beat = os.path.join(long.status_dir, "heartbeat")
    wait_for(lambda: os.path.exists(beat), timeout_s=SLOW_S)
    assert backend.job_state(long).state is JobState.RUNNING
    backend.stop_job(long)
    status = backend.job_state(long)
    assert status.state is JobState.FAILED and "stopped" in status.message
    assert gone(json.load(open(beat))["pid"])
    retry = backend.start_job(handle, JobSpec(name="long", argv=["exit", "0"]))
    assert retry.status_dir.endswith("long.2")  # the first attempt is kept for its logs
    assert ended(backend, retry).state is JobState.SUCCEEDED
    backend.teardown(handle)
    assert_nothing_left(handle)


def test_one_failed_host_fails_the_job_and_stops_the_other(backend):
    handle = ready(backend, SliceSpec(name="duo", accelerator_type="2xcpu", labels=RUN))
    # process 1 exits with 3 at once; process 0 would sleep for a minute
    spec = JobSpec(name="half", argv=["group", "60", "1", "3"], hosts=(0, 1))
    job = backend.start_job(handle, spec)
    status = ended(backend, job)
    assert status.state is JobState.FAILED and status.exit_code == 3
    assert status.message.startswith("host 1: exit code 3"), status.message
    # host 0's process is stopped rather than left waiting for its lost peer
    wait_for(lambda: "(1 other host(s) ended too)" in backend.job_state(job).message, SLOW_S)
    backend.teardown(handle)
    assert_nothing_left(handle)


def test_the_real_rlax_cli_user_error_is_a_configuration_error_on_every_host(backend, tmp_path):
    # the default entrypoint: `python -m rlax_tasks.cli` in each node's Python
    settings = {"run_root": backend.run_root, "address": backend.address, "namespace": NAMESPACE}
    cli = get_backend("ray", **settings)
    handle = ready(cli, SliceSpec(name="cli", accelerator_type="2xcpu", labels=RUN))
    argv = ["run", "--steps", "0", "--run-root", str(tmp_path / "r")]
    job = cli.start_job(handle, JobSpec(name="run", argv=argv, hosts=(0, 1)))
    status = wait_for(lambda: finished(cli, job), timeout_s=2 * SLOW_S)  # two `rlax` imports
    assert status.is_config_error, status
    assert "--steps must be a positive number" in status.message
    cli.teardown(handle)
    assert_nothing_left(handle)


def test_a_slice_the_cluster_cannot_hold_is_refused_naming_the_resource(backend):
    with pytest.raises(RayBackendError) as err:
        backend.provision(SliceSpec(name="big", accelerator_type="2xgpu-2", labels=RUN))
    assert str(err.value) == (
        "slice big (2xgpu-2): each of its 2 hosts asks for GPU: 2 on a node of its own, but 0 "
        "of the cluster's 3 node(s) have that much (the cluster has GPU: 2 in all, at most 1 on "
        "a node)"
    )
    with pytest.raises(RayBackendError, match=r"asks for GPU: 1 .* but 2 of the cluster's 3"):
        backend.provision(SliceSpec(name="wide", accelerator_type="3xgpu-1", labels=RUN))
    with pytest.raises(RayBackendError, match="is not a Ray slice type: use cpu, gpu-G"):
        backend.provision(SliceSpec(name="odd", accelerator_type="a100", labels=RUN))
    assert backend.list_slices() == []


def test_connection_errors_say_what_to_do(backend, tmp_path, monkeypatch):
    other = get_backend("ray", run_root=str(tmp_path), address="127.0.0.1:1")
    with pytest.raises(RayBackendError, match="one process, one Ray connection"):
        other.list_slices()
    # a process not yet connected: the address is checked before ray.init (which would retry
    # for minutes, then exit)
    code = (
        "from rlax_tasks.compute import get_backend\n"
        "try:\n"
        f"    get_backend('ray', run_root={str(tmp_path)!r}, address='127.0.0.1:1').list_slices()\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.startswith("cannot reach the Ray cluster at 127.0.0.1:1 ("), out
    monkeypatch.setitem(sys.modules, "ray", None)  # as where the ray extra is not installed
    with pytest.raises(RayBackendError, match=r"install the ray extra .*'\.\[ray\]'.*setup\.sh"):
        backend.list_slices()


def alive_nodes():
    return sum(n["Alive"] for n in ray.nodes())


def test_a_local_run_root_a_node_cannot_see_is_refused_naming_the_node(backend, tmp_path):
    """A node whose file system lacks the run root (started in a mount namespace of its own,
    an empty tmpfs over this test's directory: another machine's disk) makes a local run root
    an error naming that node; once the node has left, the same backend provisions."""
    before = alive_nodes()
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    start = (
        f"mount -t tmpfs none {tmp_path} && exec {ray_cli} start --address={backend.address} "
        f"--num-cpus=1 --num-gpus=0 --object-store-memory={80 * MB} --block"
    )
    node = subprocess.Popen(["unshare", "-m", "sh", "-c", start], start_new_session=True)
    try:
        wait_for(lambda: alive_nodes() == before + 1, timeout_s=SLOW_S)
        blind = [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]]
        with pytest.raises(RayBackendError, match=r"cannot see \(1 of \d\): put the run root") as e:
            backend.provision(SliceSpec(name="blind", accelerator_type="cpu", labels=RUN))
        assert any(ip in str(e.value) for ip in blind)
        assert backend.list_slices() == []
    finally:
        processes = [node, *psutil.Process(node.pid).children(recursive=True)]
        for p in processes:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                p.kill()
        node.wait()
    wait_for(lambda: alive_nodes() == before, timeout_s=SLOW_S)
    handle = backend.provision(SliceSpec(name="seen", accelerator_type="cpu", labels=RUN))
    assert not [f for f in os.listdir(backend.run_root) if f.startswith(".rlax-shared-check")]
    backend.teardown(handle)


def test_a_lost_node_preempts_the_job_and_the_slice_is_placed_again(backend, cluster):
    """Runs last: it removes a worker node, then adds another."""
    handle = ready(backend, SliceSpec(name="lossy", accelerator_type="2xgpu-1", labels=RUN))
    job = backend.start_job(handle, JobSpec(name="train", argv=["group", "120"], hosts=(0, 1)))
    beats = [os.path.join(host_status_dir(job.status_dir, h), "heartbeat") for h in (0, 1)]
    wait_for(lambda: all(map(os.path.exists, beats)), timeout_s=SLOW_S)
    assert backend.job_state(job).state is JobState.RUNNING
    # each host's process runs under the raylet of the node its bundle is on
    raylet = {n.node_id: n.all_processes["raylet"][0].process.pid for n in cluster.worker_nodes}
    pids = [json.load(open(beat))["pid"] for beat in beats]
    for host, pid in enumerate(pids):
        ancestors = [p.pid for p in psutil.Process(pid).parents()]
        assert raylet[nodes_of(handle)[host]] in ancestors

    lost = next(n for n in cluster.worker_nodes if n.node_id == nodes_of(handle)[1])
    cluster.remove_node(lost, allow_graceful=False)
    status = ended(backend, job)
    assert status.state is JobState.PREEMPTED, status
    assert status.message.startswith(f"host 1: lost: its Ray node {lost.node_ip_address} ("), status
    wait_for(lambda: gone(pids[1]), SLOW_S)  # nothing is left running on the lost node
    wait_for(lambda: gone(pids[0]), SLOW_S)  # host 0 is stopped, not left waiting
    # Ray re-places the lost bundle once a node can hold it: the retry starts there
    assert backend.slice_state(handle) is SliceState.PROVISIONING
    add_gpu_node(cluster)
    wait_for(lambda: backend.slice_state(handle) is SliceState.READY, timeout_s=SLOW_S)
    node = nodes_of(handle)
    assert lost.node_id not in node.values() and node[0] != node[1]
    retry = backend.start_job(handle, JobSpec(name="train", argv=["group", "0"], hosts=(0, 1)))
    assert retry.status_dir.endswith("train.2")
    assert ended(backend, retry).state is JobState.SUCCEEDED
    backend.teardown(handle)
    assert_nothing_left(handle)
