"""rlax_train's slice checks (``dag_support.check_slice``): what the plan task refuses before
anything is provisioned, and the runtime version it provisions with."""

from __future__ import annotations

import pytest

from rlax_tasks.airflow import dag_support as rc
from rlax_tasks.compute import tpu_types


def _refusal(*args) -> str:
    with pytest.raises(rc.PlanError) as info:
        rc.check_slice(*args)
    message = str(info.value)
    assert "\n" not in message  # one line, for the task log and the UI
    return message


@pytest.mark.parametrize(
    ("accelerator_type", "hosts", "runtime"),
    [
        ("v4-8", 1, "tpu-ubuntu2204-base"),
        ("v4-16", 2, "tpu-ubuntu2204-base"),
        ("v5p-8", 1, "v2-alpha-tpuv5"),
        ("v5litepod-8", 1, "v2-alpha-tpuv5-lite"),
        ("v6e-16", 4, "v2-alpha-tpuv6e"),
    ],
)
def test_cloud_tpu_defaults_the_runtime_of_the_accelerator_family(accelerator_type, hosts, runtime):
    assert rc.check_slice(accelerator_type, None, hosts, "cloud_tpu") == runtime
    assert runtime == tpu_types.default_runtime_version(accelerator_type)
    given = rc.check_slice(accelerator_type, "tpu-vm-v4-base.2", hosts, "cloud_tpu")
    assert given == "tpu-vm-v4-base.2"  # a given runtime version is used as is


@pytest.mark.parametrize("accelerator_type", ["cpu", "v9-8", "v4-7", "v5litepod-3", "", "V4-8"])
def test_cloud_tpu_refuses_types_it_cannot_provision(accelerator_type):
    with pytest.raises(tpu_types.UnknownAcceleratorError) as unknown:
        tpu_types.tpu_type(accelerator_type)
    message = _refusal(accelerator_type, None, 1, "cloud_tpu")
    assert message.startswith("accelerator_type: ")
    assert str(unknown.value) in message  # the table's own explanation (families, sizes)


@pytest.mark.parametrize("backend", ["cloud_tpu", "local"])
@pytest.mark.parametrize("runtime", ["", "V2-alpha", "-v2", "v2 alpha", "v2_alpha", "v2/x"])
def test_malformed_runtime_versions_are_refused(backend, runtime):
    accelerator_type = "v5litepod-8" if backend == "cloud_tpu" else "cpu"
    message = _refusal(accelerator_type, runtime, 1, backend)
    assert message.startswith(f"runtime_version: {runtime!r} ")


def test_trainer_hosts_must_match_the_hosts_of_the_type():
    assert _refusal("v4-16", None, 1, "cloud_tpu") == (
        "accelerator_type: v4-16 has 2 hosts but trainer.hosts is 1: set overrides "
        '{"trainer.hosts": 2} or pick a 1-host type (v4-8)'
    )
    assert _refusal("v4-8", None, 2, "cloud_tpu") == (
        "accelerator_type: v4-8 has 1 host but trainer.hosts is 2: set overrides "
        '{"trainer.hosts": 1} or pick a 2-host type (v4-16)'
    )
    assert _refusal("v5litepod-8", None, 4, "cloud_tpu").endswith(
        "or pick a 4-host type (v5litepod-16)"
    )
    # no v5e slice has 2 hosts (8 chips fit one): only the override is suggested
    assert _refusal("v5litepod-16", None, 2, "cloud_tpu").endswith(
        'set overrides {"trainer.hosts": 4}'
    )


def test_local_backend_keeps_ignoring_the_accelerator_type():
    """As before the checks: the local backend runs every job on this machine whatever type is
    named, so neither the type nor trainer.hosts is checked, and no runtime is defaulted."""
    assert rc.check_slice("cpu", None, 1, "local") == ""
    assert rc.check_slice("v4-16", None, 1, "local") == ""
    assert rc.check_slice("not-a-tpu", None, 3, "local") == ""
    assert rc.check_slice("cpu", "v2-alpha-tpuv5", 1, "local") == "v2-alpha-tpuv5"


def test_the_plan_refuses_a_slice_before_writing_anything(tmp_path, monkeypatch):
    """plan_training runs the checks on the run config right after loading it: nothing of the
    run is written, no model built, nothing provisioned."""
    monkeypatch.setenv("RLAX_BACKEND", "cloud_tpu")
    params = {"preset": "tiny-arith", "run_root": str(tmp_path / "runs"), "steps": 2}
    with pytest.raises(rc.PlanError, match="^accelerator_type: accelerator type 'cpu' is not"):
        rc.plan_training({**params, "accelerator_type": "cpu"}, "manual__a")
    with pytest.raises(rc.PlanError, match=r"^runtime_version: ''"):
        rc.plan_training({**params, "accelerator_type": "v4-8", "runtime_version": ""}, "manual__b")
    with pytest.raises(rc.PlanError, match=r"v4-16 has 2 hosts but trainer.hosts is 1"):
        rc.plan_training({**params, "accelerator_type": "v4-16"}, "manual__c")
    assert not (tmp_path / "runs").exists()


def test_provision_passes_the_runtime_version_to_the_operator(monkeypatch):
    monkeypatch.setenv("RLAX_BACKEND", "cloud_tpu")
    op = rc.provision("provision", "gs://b/runs", "rlax-r1-main", "r1", "v4-8", "v2-alpha-x")
    assert (op.accelerator_type, op.runtime_version) == ("v4-8", "v2-alpha-x")
    assert op.backend == "cloud_tpu"
    assert "runtime_version" in op.template_fields  # an XComArg from plan is resolved at runtime
