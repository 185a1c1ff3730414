"""Specs validate with errors that name the field; handles round-trip through JSON."""

import json

import pytest

from rlax_tasks import compute
from rlax_tasks.compute import jobstatus
from rlax_tasks.compute.jobstatus import classify_exit
from rlax_tasks.compute.types import has_labels


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
        compute.SliceSpec(**kwargs)


def test_job_spec_errors_name_the_field():
    with pytest.raises(ValueError, match="argv"):
        compute.JobSpec(name="j", argv="trainer --x")
    with pytest.raises(ValueError, match="heartbeat_timeout_s"):
        compute.JobSpec(name="j", argv=[], heartbeat_timeout_s=0)
    with pytest.raises(ValueError, match="unknown field"):
        compute.SliceSpec.from_dict({"name": "a", "colour": "red"})


def test_handles_round_trip_through_json():
    spec = compute.SliceSpec(name="s", labels={"rlax-run-id": "r1"})
    h = compute.SliceHandle("local", "s", "/x", "abc", spec.to_dict())
    assert compute.SliceHandle.from_dict(json.loads(json.dumps(h.to_dict()))) == h
    assert h.slice_spec == spec and spec.run_id == "r1"
    j = compute.JobHandle("local", "j", h.to_dict(), "/x/jobs/j", 30.0, 1.0)
    assert compute.JobHandle.from_dict(json.loads(json.dumps(j.to_dict()))) == j
    st = compute.JobStatus(compute.JobState.FAILED, "exit code 2", 2)
    assert compute.JobStatus.from_dict(st.to_dict()) == st and st.is_config_error


def test_exit_codes_are_classified():
    assert classify_exit(0, False).state is compute.JobState.SUCCEEDED
    assert classify_exit(2, False).is_config_error
    assert classify_exit(1, False).state is compute.JobState.FAILED
    assert classify_exit(-9, False).state is compute.JobState.PREEMPTED
    assert classify_exit(-15, False).state is compute.JobState.PREEMPTED
    assert (
        classify_exit(-11, False).state is compute.JobState.FAILED
    )  # SIGSEGV: a bug, not preemption
    assert classify_exit(-9, True).state is compute.JobState.FAILED  # stopped on request


def test_get_backend_rejects_unknown_names_and_settings(tmp_path):
    with pytest.raises(ValueError, match="backend='nope'"):
        compute.get_backend("nope")
    with pytest.raises(ValueError, match="colour"):
        compute.get_backend("local", run_root=str(tmp_path), colour="red")
    with pytest.raises(ValueError, match="gs://"):
        compute.get_backend("local", run_root="gs://bucket/x")


def test_job_spec_hosts_are_validated_and_round_trip():
    spec = compute.JobSpec(
        name="t", argv=["trainer"], hosts=[0, 1], env={"RLAX_COORDINATOR_PORT": "9000"}
    )
    assert spec.hosts == (0, 1) and compute.JobSpec(name="t", argv=[]).hosts == (0,)
    assert compute.JobSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    for bad in ([], [0, 0], [-1], [True], "01", [1.5], None):
        with pytest.raises(ValueError, match="hosts"):
            compute.JobSpec(name="t", argv=[], hosts=bad)
    with pytest.raises(ValueError, match="RLAX_COORDINATOR_PORT"):
        compute.JobSpec(name="t", argv=[], env={"RLAX_COORDINATOR_PORT": "http"})
    h = compute.JobHandle("cloud_tpu", "t", {}, "gs://b/j", 30.0, 1.0, hosts=[1, 0])
    assert compute.JobHandle.from_dict(json.loads(json.dumps(h.to_dict()))) == h and h.hosts == (
        1,
        0,
    )
    old = {k: v for k, v in h.to_dict().items() if k != "hosts"}  # a handle from before hosts
    assert compute.JobHandle.from_dict(old).hosts == (0,)


def test_cloud_tpu_backend_requires_an_image():
    with pytest.raises(ValueError, match="image") as err:
        compute.get_backend("cloud_tpu", run_root="gs://b/x", project="p", zone="z")
    message = str(err.value)
    assert '"image" (an extra of the compute Connection' in message and "\n" not in message
    backend = compute.get_backend(
        "cloud_tpu", run_root="gs://b/x", image="us-docker.pkg.dev/p/r/i:t"
    )
    assert backend.image == "us-docker.pkg.dev/p/r/i:t"


def test_cloud_tpu_backend_refuses_a_local_run_root_with_the_real_api(tmp_path):
    image = "us-docker.pkg.dev/p/r/i:t"
    with pytest.raises(ValueError, match=r"is a path on this machine, which TPU VMs cannot read"):
        compute.get_backend("cloud_tpu", run_root=str(tmp_path), image=image, project="p", zone="z")
    fake = compute.get_backend("cloud_tpu", run_root=str(tmp_path), image=image,
                       api_endpoint="http://127.0.0.1:1", anonymous=True)  # fmt: skip
    assert fake.run_root == str(tmp_path)  # the fake API's hosts share this machine's disk


def test_the_backends_rules_for_labels_env_and_attempts(tmp_path):
    """One owner each for what every backend applies: the managed label, the label filter, the
    run root in a job's environment, and a job started again while its last attempt runs."""
    spec = compute.SliceSpec(name="s", labels={"team": "rl"}).managed()
    assert spec.labels == {"team": "rl", compute.MANAGED_LABEL: "true"}
    assert has_labels(spec.labels, {"team": "rl"}) and has_labels(spec.labels, None)
    assert not has_labels(spec.labels, {"team": "rl", "run": "x"})
    job = compute.JobSpec(name="j", argv=[], run_root="/runs", env={"A": "1"})
    assert job.process_env() == {"A": "1", "RLAX_RUN_ROOT": "/runs"}
    own = compute.JobSpec(name="j", argv=[], run_root="/runs", env={"RLAX_RUN_ROOT": "/mine"})
    assert own.process_env() == {"RLAX_RUN_ROOT": "/mine"}

    jobs = tmp_path / "jobs"
    handle = compute.SliceHandle("local", "s", str(tmp_path), "abc", spec.to_dict())
    states = {}
    job_state = lambda h: compute.JobStatus(states[h.status_dir])  # noqa: E731
    assert jobstatus.next_attempt(str(jobs), "j", job_state) == (1, None)
    for n in (1, 2):
        first = compute.JobHandle.submitted("local", job, handle, str(jobs / f"j.{n}"))
        (jobs / f"j.{n}").mkdir(parents=True)
        jobstatus.write_json(str(jobs / f"j.{n}" / jobstatus.SPEC), {"handle": first.to_dict()})
        states[first.status_dir] = compute.JobState.FAILED
    (jobs / "other.7").mkdir()
    assert jobstatus.next_attempt(str(jobs), "j", job_state) == (3, None)
    states[first.status_dir] = compute.JobState.RUNNING
    assert jobstatus.next_attempt(str(jobs), "j", job_state) == (3, first)
    assert first.slice_handle == handle and first.hosts == job.hosts
