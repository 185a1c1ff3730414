"""The DAGs' compute backend from an Airflow Connection (AIRFLOW_CONN_<ID>: Airflow's own
environment secrets backend), looked up when a task runs; the environment is the fallback."""

from __future__ import annotations

import json

import pytest

from rlax_tasks.airflow.compute_connection import compute_backend
from rlax_tasks.compute import get_backend
from rlax_tasks.plan.slices import PlanError


def connect(monkeypatch, conn: dict, conn_id: str = "rlax_compute") -> None:
    monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", json.dumps(conn))


@pytest.fixture(autouse=True)
def _no_environment_backend(monkeypatch):
    for name in ("RLAX_BACKEND", "RLAX_BACKEND_SETTINGS", "RLAX_COMPUTE_CONN_ID",
                 "AIRFLOW_CONN_RLAX_COMPUTE"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)


def service_account_key() -> dict:
    """A service account key as Google issues them (a fresh RSA key; no Google call is made)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return {
        "type": "service_account",
        "project_id": "proj",
        "private_key_id": "k1",
        "private_key": pem.decode(),
        "client_email": "rlax@proj.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": "https://oauth2.googleapis.com/token",
    }


def test_a_google_cloud_connection_selects_cloud_tpu_with_its_project_key_and_extras(
    monkeypatch,
):
    """The Google provider's fields (project, keyfile_dict as a JSON string, its old prefixed
    form too) and the backend's own extras (zone, image); the client signs with that key."""
    key = service_account_key()
    extra = {
        "extra__google_cloud_platform__project": "proj",
        "keyfile_dict": json.dumps(key),
        "scope": "https://www.googleapis.com/auth/cloud-platform",  # the provider's own field
        "zone": "us-central2-b",
        "image": "us-docker.pkg.dev/proj/rlax/rlax-tasks:1",
    }
    connect(monkeypatch, {"conn_type": "google_cloud_platform", "extra": extra})
    name, settings = compute_backend("gs://bucket/runs")
    assert name == "cloud_tpu"
    assert settings == {
        "project": "proj", "credentials_info": key, "zone": "us-central2-b",
        "image": "us-docker.pkg.dev/proj/rlax/rlax-tasks:1", "run_root": "gs://bucket/runs",
    }  # fmt: skip
    backend = get_backend(name, **settings)
    assert (backend.project, backend.zone) == ("proj", "us-central2-b")
    credentials = backend.client._transport._credentials
    assert credentials.service_account_email == key["client_email"]


def test_a_key_file_path_is_read_as_the_google_provider_reads_it(monkeypatch, tmp_path):
    key_file = tmp_path / "key.json"
    key_file.write_text(json.dumps(service_account_key()))
    extra = {"project": "proj", "key_path": str(key_file), "zone": "z", "image": "i:1"}
    connect(monkeypatch, {"conn_type": "google_cloud_platform", "extra": extra})
    name, settings = compute_backend("gs://bucket/runs")
    backend = get_backend(name, **settings)
    assert backend.client._transport._credentials.project_id == "proj"


def test_a_ray_connection_gives_the_ray_client_address(monkeypatch):
    connect(monkeypatch, {"conn_type": "rlax_ray", "host": "ray-head", "extra": {"namespace": "n"}})
    assert compute_backend("/shared/runs") == (
        "ray",
        {"namespace": "n", "address": "ray://ray-head:10001", "run_root": "/shared/runs"},
    )
    connect(monkeypatch, {"conn_type": "rlax_ray", "host": "h", "port": 20001})
    assert compute_backend("r")[1]["address"] == "ray://h:20001"
    connect(monkeypatch, {"conn_type": "rlax_ray", "extra": {"address": "auto"}})
    assert compute_backend("r")[1]["address"] == "auto"


def test_without_the_connection_the_environment_decides(monkeypatch):
    assert compute_backend("runs") == ("local", {"run_root": "runs"})
    monkeypatch.setenv("RLAX_BACKEND", "cloud_tpu")
    monkeypatch.setenv("RLAX_BACKEND_SETTINGS", json.dumps({"zone": "z"}))
    assert compute_backend("gs://b/r") == ("cloud_tpu", {"zone": "z", "run_root": "gs://b/r"})
    # RLAX_COMPUTE_CONN_ID names the Connection to use instead of rlax_compute
    connect(monkeypatch, {"conn_type": "rlax_local"}, "my_compute")
    monkeypatch.setenv("RLAX_COMPUTE_CONN_ID", "my_compute")
    assert compute_backend("runs") == ("local", {"run_root": "runs"})


@pytest.mark.parametrize(
    ("conn", "says"),
    [
        ({"conn_type": "http", "host": "x"}, "connection type 'http' names no compute backend"),
        ({"conn_type": "rlax_ray", "extra": {"adress": "x"}}, "extra ['adress'] not ray settings"),
        ({"conn_type": "rlax_local", "extra": {"ent": "x"}}, "extra ['ent'] not local settings"),
        ({"conn_type": "google_cloud_platform", "extra": {"zonee": "z"}},
         "extra 'zonee' is not a cloud_tpu setting"),
        ({"conn_type": "google_cloud_platform", "extra": {"keyfile_dict": "{no"}},
         "keyfile_dict is not JSON"),
    ],
)  # fmt: skip
def test_a_connection_the_backends_cannot_use_is_one_line_naming_it(monkeypatch, conn, says):
    connect(monkeypatch, conn)
    with pytest.raises(PlanError) as err:
        compute_backend("runs")
    assert says in str(err.value) and "'rlax_compute'" in str(err.value)
    assert "\n" not in str(err.value)


def test_the_compute_connection_types_are_registered_with_airflow():
    """Airflow's connection form offers rlax_ray and rlax_local (this package's provider entry
    point, installed by scripts/setup.sh), each with its hook."""
    from airflow.providers_manager import ProvidersManager

    manager = ProvidersManager()
    assert "rlax-tasks" in manager.providers
    hooks = manager.hooks
    assert hooks["rlax_ray"].hook_name == "RLAX compute: Ray cluster"
    assert hooks["rlax_local"].hook_name == "RLAX compute: local processes"


def test_a_hook_reads_its_connection_as_the_tasks_do(monkeypatch):
    from rlax_tasks.airflow.compute_connection import RayClusterHook

    connect(monkeypatch, {"conn_type": "rlax_ray", "host": "head"}, "cluster_a")
    assert RayClusterHook("cluster_a").get_conn() == ("ray", {"address": "ray://head:10001"})
