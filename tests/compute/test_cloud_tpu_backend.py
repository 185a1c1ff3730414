"""The cloud_tpu backend with the real google-cloud-tpu client (REST) against the local fake
of the Cloud TPU API; the slice control directory on a local GCS emulator (real GCS client)."""

import dataclasses
import os
import re

import pytest
import requests

from rlax_tasks.compute import JobSpec, JobState, SliceSpec, SliceState, get_backend
from rlax_tasks.rundir import storage
from tests.compute.helpers import (
    ENTRYPOINT,
    FAKE_IMAGE,
    fake_backend_settings,
    fake_cloud_tpu,
    host_record,
    preempt,
    read_counter,
    tpu_slice_spec,
    wait_for,
)
from tests.paramserver.helpers import gcs_emulator

pytestmark = pytest.mark.slow

SPEC = tpu_slice_spec("w0", "v5litepod-8", "v2-alpha-tpuv5-lite")
ZONE = "us-west4-a"  # one that offers v5e (the helpers' default, us-central2-b, has v4 only)


@pytest.fixture(scope="module")
def tpu(tmp_path_factory):
    """(backend, fake URL) with the run root on the GCS emulator, shared by the module: each
    test tears down the slices it provisioned."""
    logs = tmp_path_factory.mktemp("fake-logs")
    with gcs_emulator() as bucket, fake_cloud_tpu(str(logs)) as url:
        settings = fake_backend_settings(
            url, zone=ZONE, run_root=f"{bucket}/runs", entrypoint=ENTRYPOINT
        )
        backend = get_backend("cloud_tpu", **settings)
        yield backend, url


def ready(backend, handle):
    return backend.slice_state(handle) is SliceState.READY


def finished(backend, job):
    status = backend.job_state(job)
    return status if status.state is not JobState.RUNNING else None


def addresses(backend, handle):
    """The host addresses of the slice's node (its networkEndpoints), in host order."""
    node = backend.client.get_node(name=handle.resource.replace("queuedResources", "nodes"))
    return [e.ip_address for e in node.network_endpoints]


def test_lifecycle_and_outcomes(tpu):
    backend, url = tpu
    handle = backend.provision(SPEC)
    assert handle.resource == "projects/proj/locations/us-west4-a/queuedResources/w0"
    assert handle.root.startswith("gs://") and handle.root.endswith(handle.instance_id)
    assert backend.provision(SPEC) == handle  # idempotent by name
    assert backend.slice_state(handle) in (SliceState.PROVISIONING, SliceState.READY)
    wait_for(lambda: ready(backend, handle))
    with pytest.raises(ValueError, match=r"hosts=\[0, 1\] but slice w0 \(v5litepod-8\) has 1"):
        backend.start_job(handle, JobSpec(name="two", argv=["exit", "0"], hosts=(0, 1)))

    ok = backend.start_job(handle, JobSpec(name="ok", argv=["env", "RLAX_X"], env={"RLAX_X": "7"}))
    bad = backend.start_job(handle, JobSpec(name="bad", argv=["exit", "2"]))
    assert wait_for(lambda: finished(backend, ok)).state is JobState.SUCCEEDED
    assert storage.read_bytes(storage.join(ok.status_dir, "stdout.log")).strip() == b"RLAX_X=7"
    status = wait_for(lambda: finished(backend, bad))
    assert status.is_config_error and "exiting with 2" in status.message

    long = backend.start_job(handle, JobSpec(name="long", argv=["sleep", "60"]))
    wait_for(lambda: storage.exists(storage.join(long.status_dir, "heartbeat")))
    backend.stop_job(long)
    status = wait_for(lambda: finished(backend, long))
    assert status.state is JobState.FAILED and "stopped" in status.message

    assert [h.name for h in backend.list_slices({"rlax-run-id": "r1"})] == ["w0"]
    assert backend.list_slices({"rlax-run-id": "other"}) == []
    backend.teardown(handle)
    backend.teardown(handle)  # idempotent
    assert backend.slice_state(handle) is SliceState.DELETED
    assert requests.get(f"{url}/fake/state", timeout=5).json()["agents"] == {}


def test_preemption_mid_run_then_reprovision_and_resume(tpu, tmp_path):
    backend, url = tpu
    ckpt = str(tmp_path / "ckpt")  # the job's "checkpoint": resumption is the job's own logic
    job_spec = JobSpec(name="train", argv=["count", ckpt, "25", "0.1"], heartbeat_timeout_s=10)
    handle = backend.provision(SPEC)
    wait_for(lambda: ready(backend, handle))
    (old_address,) = addresses(backend, handle)
    job = backend.start_job(handle, job_spec)
    wait_for(lambda: read_counter(ckpt) >= 3)

    preempt(url, "w0")  # spot reclaim: node and processes die at once
    status = wait_for(lambda: finished(backend, job))
    assert status.state is JobState.PREEMPTED and "SUSPENDED by SERVICE" in status.message
    assert backend.slice_state(handle) is SliceState.PREEMPTED
    progress = read_counter(ckpt)
    assert 3 <= progress < 25

    again = backend.provision(handle.slice_spec)  # replaces the suspended queued resource
    assert again.instance_id != handle.instance_id and again.name == handle.name
    assert backend.slice_state(handle) is SliceState.DELETED  # the old handle is stale
    wait_for(lambda: ready(backend, again))
    (new_address,) = addresses(backend, again)  # a re-created TPU VM has a new internal IP
    assert new_address != old_address and "127.0.0.1" not in (old_address, new_address)
    assert wait_for(lambda: host_record(again.root, 0))["address"] == new_address
    resumed = backend.start_job(again, job_spec)
    assert resumed.status_dir != job.status_dir
    status = wait_for(lambda: finished(backend, resumed), timeout_s=60)
    assert status.state is JobState.SUCCEEDED
    out = storage.read_bytes(storage.join(resumed.status_dir, "stdout.log")).decode()
    resumed_from = int(out.split("resumed from step ")[1].split()[0])
    assert resumed_from >= progress and read_counter(ckpt) == 25
    backend.teardown(again)


def test_capacity_failure_and_api_errors(tpu):
    backend, url = tpu
    handle = backend.provision(SPEC)
    reply = requests.post(f"{url}/fake/fail-capacity", json={"name": "w0"}, timeout=5)
    assert reply.json()["state"]["state"] == "FAILED"
    assert backend.slice_state(handle) is SliceState.FAILED
    again = backend.provision(SPEC)  # a failed queued resource is replaced
    assert again.instance_id != handle.instance_id
    with pytest.raises(ValueError, match="runtime_version"):
        backend.provision(SliceSpec(name="w1", accelerator_type="v5litepod-8"))
    no_zone = get_backend(
        "cloud_tpu", run_root="gs://b/x", project="p", api_endpoint=url, image=FAKE_IMAGE
    )
    with pytest.raises(ValueError, match="zone"):
        no_zone.provision(SPEC)
    backend.teardown(again)


def test_reserved_capacity_service_account_and_network_reach_the_node(tpu):
    backend, url = tpu
    spec = dataclasses.replace(
        SPEC, name="w9", spot=False, reserved=True, service_account="rl@p.iam.gserviceaccount.com",
        network="rl-net", subnetwork="rl-subnet",
    )  # fmt: skip
    handle = backend.provision(spec)
    qr = backend.client.get_queued_resource(name=handle.resource)
    node = qr.tpu.node_spec[0].node
    assert "spot" not in qr and node.scheduling_config.reserved and not node.scheduling_config.spot
    assert node.service_account.email == "rl@p.iam.gserviceaccount.com"
    assert (node.network_config.network, node.network_config.subnetwork) == ("rl-net", "rl-subnet")
    assert SliceSpec.from_dict(handle.spec).capacity == "reserved"  # as the API reports it
    with pytest.raises(ValueError, match="spot or reserved, not both"):
        dataclasses.replace(spec, spot=True)
    # what the real API refuses, the fake refuses too
    body = {"tpu": {"nodeSpec": [{"node": {
        "acceleratorType": "v5litepod-8", "runtimeVersion": "v2-alpha-tpuv5-lite",
        "schedulingConfig": {"spot": True, "reserved": True}}}]}}  # fmt: skip
    parent = handle.resource.split("/queuedResources/")[0]
    reply = requests.post(f"{url}/v2/{parent}/queuedResources?queuedResourceId=w8", json=body,
                          timeout=5)  # fmt: skip
    assert reply.status_code == 400 and "both spot and reserved" in reply.text, reply.text
    backend.teardown(handle)


@pytest.mark.parametrize(
    ("accelerator_type", "runtime", "zone", "says"),
    [
        ("v5litepod-8", "v2-alpha-tpuv5-lite", "us-central2-b",
         "Accelerator type v5litepod-8 is not available in zone us-central2-b"),
        ("v4-8", "v2-alpha-tpuv5", "us-central2-b",
         "Runtime version 'v2-alpha-tpuv5' is not supported for accelerator type v4-8"),
        ("v6e-2", "v2-alpha-tpuv6e", "us-east5-a", "Invalid accelerator type: 'v6e-2'"),
    ],
)  # fmt: skip
def test_what_the_real_api_refuses_the_fake_refuses_from_its_own_table(
    tpu, accelerator_type, runtime, zone, says
):
    """The fake checks types, zones and runtimes against Google's documentation (its own
    catalogue), not the product's table: the product learns of such a mistake as from the API."""
    backend, _ = tpu
    spec = tpu_slice_spec("w7", accelerator_type, runtime, zone=zone)
    with pytest.raises(Exception, match=re.escape(says)):
        backend.provision(spec)
    assert "w7" not in [h.name for h in backend.list_slices({"rlax-run-id": "r1"})]


def test_startup_script_is_sent_as_node_metadata(tpu):
    backend, url = tpu
    handle = backend.provision(SPEC)
    wait_for(lambda: ready(backend, handle))
    node = backend.client.get_node(name=handle.resource.replace("queuedResources", "nodes"))
    script = node.metadata["startup-script"]
    assert script.startswith("#!/bin/bash") and "rlax_tasks.compute.agent" in script
    assert node.metadata["rlax-slice-root"] == handle.root
    assert node.scheduling_config.spot
    with open(os.path.join(os.path.dirname(__file__), "../../infra/tpu/startup.sh")) as fh:
        assert fh.read() == script
    backend.teardown(handle)
