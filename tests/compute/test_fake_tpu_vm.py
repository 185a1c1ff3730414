"""The stand-ins a fake TPU VM host runs the real startup script with: the docker CLI resolves
commands from infra/Dockerfile's ENTRYPOINT and CMD as docker does, so the old startup line
(`docker run IMAGE python -m ...` under ENTRYPOINT `tini -- rlax`) fails here as on a TPU VM.
Every host of every node creation has a loopback address of its own, as TPU VMs have their own
internal IPs."""

import json
import os
import socket
import subprocess
import sys
import uuid

import pytest

from infra.fakes import docker_cli
from infra.fakes.cloud_tpu import ApiError, FakeCloudTpu
from infra.fakes.tpu_vm import BIN, HOST_VAR, allocate_host_addresses
from tests.compute.helpers import FAKE_IMAGE, REPO, host_record, wait_for

AGENT = ["-m", "rlax_tasks.compute.agent", "--worker", "0", "--poll", "0.2"]


def test_the_image_config_is_parsed_from_the_dockerfile(tmp_path):
    runtime = docker_cli.image_config(os.path.join(REPO, "infra", "Dockerfile"), "runtime")
    assert runtime.entrypoint == ["tini", "--", "rlax"] and runtime.cmd == ["--help"]
    assert runtime.env["PYTHONUNBUFFERED"] == "1" and "JAX_PLATFORMS" not in runtime.env
    airflow = docker_cli.image_config(os.path.join(REPO, "infra", "Dockerfile"), "airflow")
    assert airflow.entrypoint == ["tini", "--"] and airflow.cmd == ["airflow", "version"]
    assert airflow.env["PYTHONUNBUFFERED"] == "1"  # inherited from the runtime stage

    resolve = docker_cli.container_command
    assert resolve(runtime, None, []) == ["tini", "--", "rlax", "--help"]
    assert resolve(runtime, None, ["python", "-V"]) == ["tini", "--", "rlax", "python", "-V"]
    assert resolve(runtime, "tini", ["--", "python", "-V"]) == ["tini", "--", "python", "-V"]
    assert resolve(runtime, "tini", []) == ["tini"]  # --entrypoint drops the image's CMD

    other = tmp_path / "Dockerfile"
    other.write_text(
        'FROM python:3.11 AS runtime\nENV A=1 \\\n    B="two words"\n'
        'CMD ["serve"]\nENTRYPOINT python -m app\n'
    )
    config = docker_cli.image_config(other, "runtime")
    assert config.entrypoint == ["/bin/sh", "-c", "python -m app"] and config.cmd == []
    assert config.env == {"A": "1", "B": "two words"}


@pytest.fixture
def docker(tmp_path):
    """docker(*args) → CompletedProcess of the stand-in CLI on a host of its own."""
    host = f"test-host-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "RLAX_FAKE_PYTHON": sys.executable,
        "RLAX_FAKE_DOCKER_STATE": str(tmp_path / "docker"),
        "RLAX_FAKE_DOCKER_IMAGES": FAKE_IMAGE,
        HOST_VAR: host,
    }

    def run(*args):
        return subprocess.run(
            [str(BIN / "docker"), *args], env=env, capture_output=True, text=True, timeout=60
        )

    yield run
    docker_cli.kill_marked(HOST_VAR, [host])


def inspect(docker, name):
    out = docker("inspect", name)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)[0]


def test_pull_knows_only_the_registered_images(docker):
    assert docker("pull", FAKE_IMAGE).returncode == 0
    missing = docker("pull", "us-docker.pkg.dev/p/r/unknown:1")
    assert missing.returncode == 1 and "manifest unknown" in missing.stderr
    run = docker("run", "-d", "--name", "x", "us-docker.pkg.dev/p/r/unknown:1")
    assert run.returncode == 125 and "manifest unknown" in run.stderr
    assert docker("rm", "-f", "nothing-here").returncode == 0
    assert docker("rm", "nothing-here").returncode == 1


@pytest.mark.slow
def test_the_old_startup_line_fails_and_the_new_one_runs_the_agent(docker, tmp_path):
    root = str(tmp_path / "slice")
    agent = [*AGENT, "--slice-root", root]
    # before: the image's ENTRYPOINT `tini -- rlax` makes it `rlax python ...`, restarted forever
    old_line = ["--restart=on-failure", "--net=host", "-e", "RLAX_WORKER_ID=0", FAKE_IMAGE]
    old = docker("run", "-d", "--name", "old", *old_line, "python", *agent)
    assert old.returncode == 0, old.stderr
    wait_for(lambda: inspect(docker, "old")["RestartCount"] >= 1, timeout_s=60)
    record = inspect(docker, "old")
    assert [record["Path"], *record["Args"]] == ["tini", "--", "rlax", "python", *agent]
    assert record["State"]["ExitCode"] == 2  # rlax's usage error, from the first run
    assert "invalid choice: 'python'" in docker("logs", "old").stdout
    assert host_record(root, 0) is None
    assert docker("rm", "-f", "old").returncode == 0

    # after (infra/tpu/startup.sh): tini as the entrypoint, python under it
    agent = [*agent, "--address", "10.1.2.3"]
    new_line = ["--restart=on-failure", "--net=host", "-e", "RLAX_WORKER_ID=0", "--entrypoint"]
    new = docker(
        "run", "-d", "--name", "rlax-agent", *new_line, "tini", FAKE_IMAGE, "--", "python", *agent
    )
    assert new.returncode == 0, new.stderr
    assert wait_for(lambda: host_record(root, 0), timeout_s=60)["address"] == "10.1.2.3"
    record = inspect(docker, "rlax-agent")
    assert [record["Path"], *record["Args"]] == ["tini", "--", "python", *agent]
    assert record["State"]["Running"] and record["RestartCount"] == 0
    again = docker("run", "-d", "--name", "rlax-agent", "--entrypoint", "tini", FAKE_IMAGE, "x")
    assert again.returncode == 125 and "already in use" in again.stderr


def test_every_host_of_every_node_creation_gets_an_address_of_its_own():
    first, second = allocate_host_addresses(2), allocate_host_addresses(2)
    big = allocate_host_addresses(300)  # more hosts than one /24 holds
    after = allocate_host_addresses(1)
    every = [*first, *second, *big, *after]
    assert len(every) == len(set(every)) == 305
    for address in every:
        octets = [int(o) for o in address.split(".")]
        assert octets[0] == 127 and octets[1] != 0 and octets[3] not in (0, 255)
        socket.inet_aton(address)
    # host K is .K+1 of its node's block
    assert [a.rsplit(".", 1)[1] for a in first] == ["1", "2"]
    assert first[0].rsplit(".", 1)[0] == first[1].rsplit(".", 1)[0] != second[0].rsplit(".", 1)[0]
    assert big[253].endswith(".254") and big[254].endswith(".1")
    # loopback: bindable and reachable with no setup, as the hosts' services need
    with socket.create_server((first[1], 0)) as server:
        with socket.create_connection(server.getsockname()[:2], timeout=5):
            pass
    with pytest.raises(ValueError):
        allocate_host_addresses(0)


def test_the_api_gives_each_host_its_address_and_a_re_created_node_new_ones(tmp_path):
    fake = FakeCloudTpu(provision_delay_s=0.0, run_agents=False, log_dir=str(tmp_path))
    parent = "projects/p/locations/us-central2-b"
    node = f"{parent}/nodes/n"
    body = {
        "tpu": {
            "nodeSpec": [
                {
                    "parent": parent,
                    "nodeId": "n",
                    "node": {"acceleratorType": "v4-32", "runtimeVersion": "tpu-ubuntu2204-base"},
                }
            ]
        }
    }

    def ready():
        try:
            return fake.get_node(node)["state"] == "READY" and fake.get_node(node)
        except ApiError:
            return None

    def endpoints():
        ips = [e["ipAddress"] for e in wait_for(ready)["networkEndpoints"]]
        md = "instance/network-interfaces/0/ip"
        assert [fake.metadata(node, k, md) for k in range(len(ips))] == ips
        return ips

    try:
        fake.create(parent, "n", body)
        before = endpoints()
        assert len(before) == len(set(before)) == 4 and "127.0.0.1" not in before
        fake.preempt("n")
        fake.delete(f"{parent}/queuedResources/n", force=True)
        fake.create(parent, "n", body)
        after = endpoints()
        assert len(set(after)) == 4 and not set(after) & set(before)
    finally:
        fake.close()
