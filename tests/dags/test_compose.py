"""docker-compose.yaml and infra/Dockerfile: parsed and checked (no Docker engine runs here);
`docker compose config` also runs where the binary exists."""

from __future__ import annotations

import ast
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import urllib.parse

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


# --------------------------------------------------------------- what the compose file does
def _airflow_commands(compose: dict) -> dict[str, list[str]]:
    """Every `airflow` command line the stack runs, by where it is: each service's command, the
    init script's lines, the healthchecks' (compose's ``$$`` unescaped, $HOSTNAME filled in)."""
    out = {}
    for name, svc in compose["services"].items():
        command = svc.get("command") or []
        if command[:1] == ["airflow"]:
            out[f"{name} command"] = command
        if command[:2] == ["bash", "-c"]:
            for i, line in enumerate(command[2].splitlines()):
                if line.strip().startswith("airflow "):
                    out[f"{name} script line {i + 1}"] = shlex.split(line)
        test = svc.get("healthcheck", {}).get("test") or []
        shell = test[1] if test[:1] == ["CMD-SHELL"] else None
        argv = shlex.split(shell.replace("$${HOSTNAME}", "host")) if shell else test[1:]
        if argv[:1] == ["airflow"]:
            out[f"{name} healthcheck"] = argv
    return out


def test_every_airflow_command_parses_with_the_installed_airflow_cli(compose):
    """Each `airflow ...` the stack runs is a command of the Airflow this project pins (its own
    argument parser: a renamed subcommand or a --job-type it does not know fails here)."""
    from airflow.cli.cli_parser import get_parser

    commands = _airflow_commands(compose)
    where = {w.split()[0] for w in commands}
    assert {*AIRFLOW_SERVICES, "airflow-init"} <= where, where
    assert any(w.endswith("healthcheck") for w in commands)
    parser = get_parser()
    for place, argv in commands.items():
        try:
            parser.parse_args(argv[1:])
        except SystemExit as e:  # argparse's way of refusing
            pytest.fail(f"{place}: {shlex.join(argv)!r} is not an Airflow command ({e.code})")
    with pytest.raises(SystemExit):  # the check can fail: a job type this Airflow lacks
        parser.parse_args(["jobs", "check", "--job-type", "DagFileProcessorJob"])


def test_the_init_script_and_the_ray_commands_parse(compose):
    """The init service's Python creates the bucket with modules the image has; the Ray nodes'
    commands and healthcheck are options of the pinned Ray's CLI."""
    import importlib.util

    from ray.scripts.scripts import start, status

    script = compose["services"]["airflow-init"]["command"][2]
    python = script.split("<<'PY'\n", 1)[1].split("\nPY", 1)[0]
    tree = ast.parse(python)
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module
    services = compose["services"]
    for name in ("ray-head", "ray-worker"):
        command = services[name]["command"]
        assert command[:2] == ["ray", "start"]
        start.make_context("start", command[2:])  # click raises on an unknown option
    check = services["ray-head"]["healthcheck"]["test"]
    status.make_context("status", check[3:])


def _airflow_option(name: str) -> tuple[str, str] | None:
    """(section, key) of an ``AIRFLOW__SECTION__KEY`` variable, None for another name."""
    if not name.startswith("AIRFLOW__"):
        return None
    section, key = name[len("AIRFLOW__") :].split("__", 1)
    return section.lower(), key.lower()


def _read_by_the_project(name: str) -> bool:
    """Whether ``name`` is a string literal in the project's code (rlax_tasks/, dags/, plugins/)."""
    pattern = re.compile(rf"[\"']{re.escape(name)}[\"']")
    for folder in ("rlax_tasks", "dags", "plugins"):
        for path in glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True):
            with open(path, encoding="utf-8") as f:
                if pattern.search(f.read()):
                    return True
    return False


def test_every_setting_the_services_get_is_read_by_someone(compose):
    """Each ``AIRFLOW__S__K`` is an option of the pinned Airflow's configuration (a misspelt
    one would be ignored silently) and each ``RLAX_*`` a name the project's code reads."""
    from airflow.configuration import conf

    described = conf.configuration_description
    names = set()
    for svc in compose["services"].values():
        env = svc.get("environment") or {}
        names |= set(env if isinstance(env, dict) else (e.split("=")[0] for e in env))
    assert "AIRFLOW__CORE__EXECUTOR" in names and "RLAX_RUN_ROOT" in names
    for name in sorted(names):
        option = _airflow_option(name)
        if option is not None:
            section, key = option
            assert key in described.get(section, {}).get("options", {}), f"{name}: no such option"
        elif name.startswith("RLAX_"):
            assert _read_by_the_project(name), f"{name}: nothing in rlax_tasks/ reads it"
    assert _airflow_option("AIRFLOW__CORE__EXECUTORS") == ("core", "executors")
    assert "executors" not in described["core"]["options"]  # the check can fail
    assert not _read_by_the_project("RLAX_RUN_ROOTZ")


def test_healthchecks_probe_what_the_services_serve(compose):
    """The api-server's healthcheck asks a route the pinned Airflow serves, on its port; the
    scheduler's, the health server it starts (enabled, on its default port)."""
    import airflow
    from airflow.configuration import conf

    options = conf.configuration_description
    services = compose["services"]
    env = services["airflow-scheduler"]["environment"]
    api = urllib.parse.urlsplit(services["airflow-apiserver"]["healthcheck"]["test"][-1])
    assert api.port == int(options["api"]["options"]["port"]["default"])
    assert f"{api.port}:{api.port}" in services["airflow-apiserver"]["ports"]
    spec = os.path.join(os.path.dirname(airflow.__file__), "api_fastapi", "core_api", "openapi",
                        "v2-rest-api-generated.yaml")  # fmt: skip
    with open(spec, encoding="utf-8") as f:
        assert api.path in yaml.safe_load(f)["paths"], api.path
    scheduler = urllib.parse.urlsplit(services["airflow-scheduler"]["healthcheck"]["test"][-1])
    health = options["scheduler"]["options"]["scheduler_health_check_server_port"]["default"]
    assert scheduler.port == int(health)
    assert env["AIRFLOW__SCHEDULER__ENABLE_HEALTH_CHECK"] == "true"


def _tracked(folder: str) -> bool:
    """Whether a fresh clone has ``folder`` (git tracks a file under it)."""
    out = subprocess.run(["git", "ls-files", "--", folder], cwd=REPO, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return bool(out.stdout.strip())


def _dockerfile_env(name: str) -> str:
    with open(os.path.join(REPO, "infra", "Dockerfile"), encoding="utf-8") as f:
        values = re.findall(rf"^ENV {name}=(\S+)$", f.read(), re.M)
    assert values, f"infra/Dockerfile sets no {name}"
    return values[-1]


def test_mounts_land_where_the_image_reads_and_exist_before_docker_makes_them(compose):
    """The dags/ and plugins/ mounts are the image's Airflow's folders (its AIRFLOW_HOME), the
    run root's is RLAX_RUN_ROOT; each bind source is in the repository or made by the documented
    commands before `docker compose up` (Docker would create it as root, which the services'
    user, AIRFLOW_UID, could not write)."""
    from airflow.configuration import conf

    home = _dockerfile_env("AIRFLOW_HOME")
    options = conf.configuration_description["core"]["options"]
    folders = {
        options[k]["default"].replace("{AIRFLOW_HOME}", home)
        for k in ("dags_folder", "plugins_folder")
    }
    with open(os.path.join(REPO, "docs", "operations.md"), encoding="utf-8") as f:
        docs = f.read()
    up = docs.index("docker compose up -d --build")
    made = set(re.findall(r"^mkdir -p (\S+)", docs[:up], re.M))
    for name in (*AIRFLOW_SERVICES, "airflow-init", "ray-head", "ray-worker"):
        svc = compose["services"][name]
        mounts = dict(v.split(":")[:2] for v in svc["volumes"])
        binds = {src: dst for src, dst in mounts.items() if src.startswith(".")}
        for src in binds:
            rel = os.path.normpath(src)
            assert _tracked(rel) or rel in made, f"{name}: {src} is not in a fresh clone"
        if name.startswith("airflow"):
            assert folders <= set(mounts.values()), (name, folders)
            assert svc["environment"]["RLAX_RUN_ROOT"] in binds.values()


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
