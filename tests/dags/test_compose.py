"""docker-compose.yaml and infra/Dockerfile: parsed and checked (no Docker engine runs here);
`docker compose config` also runs where the binary exists."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from tests.dags.conftest import REPO

COMPOSE = os.path.join(REPO, "docker-compose.yaml")
AIRFLOW_SERVICES = ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                    "airflow-triggerer")  # fmt: skip


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(COMPOSE) as f:
        return yaml.safe_load(f)  # resolves the x-airflow-common anchors and merges


def test_services_images_and_commands(compose):
    services = compose["services"]
    assert {"postgres", "gcs", "airflow-init", *AIRFLOW_SERVICES} <= set(services)
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["gcs"]["image"].startswith("fsouza/fake-gcs-server:")
    for name in (*AIRFLOW_SERVICES, "airflow-init"):
        svc = services[name]
        assert svc["build"]["dockerfile"] == "infra/Dockerfile" and svc["build"]["target"]
        assert svc["build"]["context"] == "."
    commands = {name: services[name]["command"][:2] for name in AIRFLOW_SERVICES}
    assert commands == {
        "airflow-apiserver": ["airflow", "api-server"],
        "airflow-scheduler": ["airflow", "scheduler"],
        "airflow-dag-processor": ["airflow", "dag-processor"],
        "airflow-triggerer": ["airflow", "triggerer"],
    }
    assert "airflow db migrate" in services["airflow-init"]["command"][2]


def test_environment_points_everything_at_postgres_and_the_emulator(compose):
    for name in (*AIRFLOW_SERVICES, "airflow-init"):
        env = compose["services"][name]["environment"]
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")
        assert "@postgres:5432/" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"].startswith(
            "http://airflow-apiserver:8080/"
        )
        assert env["STORAGE_EMULATOR_HOST"] == "http://gcs:4443"
        assert env["RLAX_RUN_ROOT"] in env["RLAX_RUN_ROOTS"].split(",")
        assert "gs://rlax-runs" in env["RLAX_RUN_ROOTS"].split(",")
        mounts = {v.split(":")[1] for v in compose["services"][name]["volumes"]}
        assert {"/opt/airflow/dags", "/opt/airflow/plugins", env["RLAX_RUN_ROOT"]} <= mounts
        for src in ("./dags", "./plugins"):
            assert os.path.isdir(os.path.join(REPO, src))


def test_healthchecks_and_start_order(compose):
    services = compose["services"]
    for name in ("postgres", "gcs", *AIRFLOW_SERVICES):
        hc = services[name]["healthcheck"]
        assert hc["test"][0] in ("CMD", "CMD-SHELL") and hc["retries"] >= 3
    for name in AIRFLOW_SERVICES:
        deps = services[name]["depends_on"]
        assert deps["postgres"]["condition"] == "service_healthy"
        assert deps["gcs"]["condition"] == "service_healthy"
        assert deps["airflow-init"]["condition"] == "service_completed_successfully"
    assert services["airflow-apiserver"]["ports"] == ["8080:8080"]
    # named volumes used by services are declared
    declared = set(compose["volumes"])
    for svc in services.values():
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            if not src.startswith((".", "/")):
                assert src in declared


def test_the_ray_profile_adds_a_head_and_a_worker_on_airflows_run_root(compose):
    """`docker compose --profile ray up`: a Ray head (client port 10001) and a worker node from
    the Airflow services' image (one Ray version on both sides, the ray extra installed), the
    run root mounted at the same path; the Airflow services reach it as the rlax_ray
    Connection, read by the same code the tasks use."""
    from airflow.sdk import Connection

    from rlax_tasks.airflow.compute_connection import backend_from_connection

    services = compose["services"]
    airflow = services["airflow-scheduler"]
    root = airflow["environment"]["RLAX_RUN_ROOT"]
    runs = next(v for v in airflow["volumes"] if v.endswith(f":{root}"))
    head, worker = services["ray-head"], services["ray-worker"]
    for svc in (head, worker):
        assert svc["profiles"] == ["ray"]
        assert (svc["image"], svc["build"]) == (airflow["image"], airflow["build"])
        assert runs in svc["volumes"]
    assert airflow["build"]["args"]["RLAX_EXTRAS"] == "[ray]"
    assert head["command"][:3] == ["ray", "start", "--head"]
    assert "--ray-client-server-port=10001" in head["command"] and "--block" in head["command"]
    assert head["healthcheck"]["test"][:3] == ["CMD", "ray", "status"]
    assert "--address=ray-head:6379" in worker["command"]
    assert worker["depends_on"]["ray-head"]["condition"] == "service_healthy"
    assert "profiles" not in airflow  # Airflow itself runs in every profile
    conn = Connection(
        conn_id="rlax_ray", **json.loads(airflow["environment"]["AIRFLOW_CONN_RLAX_RAY"])
    )
    assert backend_from_connection(conn) == ("ray", {"address": "ray://ray-head:10001"})
    # rlax_compute unless the command line names rlax_ray (compose interpolates it)
    assert airflow["environment"]["RLAX_COMPUTE_CONN_ID"] == "${RLAX_COMPUTE_CONN_ID:-rlax_compute}"


def test_dockerfile_targets_and_pins():
    with open(os.path.join(REPO, "infra", "Dockerfile")) as f:
        text = f.read()
    stages = [line.split()[-1] for line in text.splitlines() if line.startswith("FROM ")]
    assert stages == ["runtime", "tpu", "gpu", "airflow"]  # airflow last: the default target
    for accelerator in ("tpu", "gpu"):  # each variant installs its pinned extra
        assert f'pip install -c constraints.txt ".[{accelerator}]"' in text
    assert "-c constraints.txt" in text and "COPY rlax_tasks" in text
    assert 'pip install -c constraints.txt ".${RLAX_EXTRAS}"' in text  # compose: "[ray]"
    # every path the Dockerfile copies exists in the build context (the repository root)
    for line in text.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for src in [w for w in line.split()[1:-1] if not w.startswith("--")]:
                assert os.path.exists(os.path.join(REPO, src)), src


@pytest.mark.skipif(
    shutil.which("docker-compose") is None
    and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0
    if shutil.which("docker")
    else shutil.which("docker-compose") is None,
    reason="no docker compose binary on this machine (the YAML checks above still ran)",
)
def test_docker_compose_config_validates():
    compose = ["docker-compose"] if shutil.which("docker-compose") else ["docker", "compose"]
    for profile in ([], ["--profile", "ray"]):
        cmd = [*compose, "-f", COMPOSE, *profile, "config", "--quiet"]
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        assert result.returncode == 0, (profile, result.stderr)
