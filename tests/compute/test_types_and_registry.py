"""Specs validate with errors that name the field; handles round-trip through JSON."""

import json

import pytest

from rlax_tasks.compute import (
    JobHandle,
    JobSpec,
    JobState,
    JobStatus,
    SliceHandle,
    SliceSpec,
    get_backend,
)
from rlax_tasks.compute.jobstatus import classify_exit


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "Bad_Name"}, "name"),
        ({"name": "ok", "accelerator_type": ""}, "accelerator_type"),
        ({"name": "ok", "spot": "yes"}, "spot"),
        ({"name": "ok", "labels": {"Key": "v"}}, "labels"),
    ],
)
def test_slice_spec_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SliceSpec(**kwargs)


def test_job_spec_errors_name_the_field():
    with pytest.raises(ValueError, match="argv"):
        JobSpec(name="j", argv="trainer --x")
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        JobSpec(name="j", argv=[], heartbeat_timeout_s=0)
    with pytest.raises(ValueError, match="unknown field"):
        SliceSpec.from_dict({"name": "a", "colour": "red"})


def test_handles_round_trip_through_json():
    spec = SliceSpec(name="s", labels={"rlax-run-id": "r1"})
    h = SliceHandle("local", "s", "/x", "abc", spec.to_dict())
    assert SliceHandle.from_dict(json.loads(json.dumps(h.to_dict()))) == h
    assert h.slice_spec == spec and spec.run_id == "r1"
    j = JobHandle("local", "j", h.to_dict(), "/x/jobs/j", 30.0, 1.0)
    assert JobHandle.from_dict(json.loads(json.dumps(j.to_dict()))) == j
    st = JobStatus(JobState.FAILED, "exit code 2", 2)
    assert JobStatus.from_dict(st.to_dict()) == st and st.is_config_error


def test_exit_codes_are_classified():
    assert classify_exit(0, False).state is JobState.SUCCEEDED
    assert classify_exit(2, False).is_config_error
    assert classify_exit(1, False).state is JobState.FAILED
    assert classify_exit(-9, False).state is JobState.PREEMPTED
    assert classify_exit(-15, False).state is JobState.PREEMPTED
    assert classify_exit(-11, False).state is JobState.FAILED  # SIGSEGV: a bug, not preemption
    assert classify_exit(-9, True).state is JobState.FAILED  # stopped on request


def test_get_backend_rejects_unknown_names_and_settings(tmp_path):
    with pytest.raises(ValueError, match="backend='nope'"):
        get_backend("nope")
    with pytest.raises(ValueError, match="colour"):
        get_backend("local", run_root=str(tmp_path), colour="red")
    with pytest.raises(ValueError, match="gs://"):
        get_backend("local", run_root="gs://bucket/x")


def test_job_spec_hosts_are_validated_and_round_trip():
    spec = JobSpec(name="t", argv=["trainer"], hosts=[0, 1], env={"RLAX_COORDINATOR_PORT": "9000"})
    assert spec.hosts == (0, 1) and JobSpec(name="t", argv=[]).hosts == (0,)
    assert JobSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    for bad in ([], [0, 0], [-1], [True], "01", [1.5], None):
        with pytest.raises(ValueError, match="hosts"):
            JobSpec(name="t", argv=[], hosts=bad)
    with pytest.raises(ValueError, match="RLAX_COORDINATOR_PORT"):
        JobSpec(name="t", argv=[], env={"RLAX_COORDINATOR_PORT": "http"})
    h = JobHandle("cloud_tpu", "t", {}, "gs://b/j", 30.0, 1.0, hosts=[1, 0])
    assert JobHandle.from_dict(json.loads(json.dumps(h.to_dict()))) == h and h.hosts == (1, 0)
    old = {k: v for k, v in h.to_dict().items() if k != "hosts"}  # a handle from before hosts
    assert JobHandle.from_dict(old).hosts == (0,)


def test_cloud_tpu_backend_requires_an_image():
    with pytest.raises(ValueError, match="image") as err:
        get_backend("cloud_tpu", run_root="gs://b/x", project="p", zone="z")
    message = str(err.value)
    assert '"image" (an extra of the compute Connection' in message and "\n" not in message
    backend = get_backend("cloud_tpu", run_root="gs://b/x", image="us-docker.pkg.dev/p/r/i:t")
    assert backend.image == "us-docker.pkg.dev/p/r/i:t"


def test_cloud_tpu_backend_refuses_a_local_run_root_with_the_real_api(tmp_path):
    image = "us-docker.pkg.dev/p/r/i:t"
    with pytest.raises(ValueError, match=r"is a path on this machine, which TPU VMs cannot read"):
        get_backend("cloud_tpu", run_root=str(tmp_path), image=image, project="p", zone="z")
    fake = get_backend("cloud_tpu", run_root=str(tmp_path), image=image,
                       api_endpoint="http://127.0.0.1:1", anonymous=True)  # fmt: skip
    assert fake.run_root == str(tmp_path)  # the fake API's hosts share this machine's disk
