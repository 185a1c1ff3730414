"""Which compute backend the DAGs' tasks use, and its settings, from an Airflow Connection
(docs/design.md §10), looked up when a task runs, never when the scheduler parses the DAG files.

The Connection ``rlax_compute`` (``RLAX_COMPUTE_CONN_ID`` names another) selects the backend by
its type: ``google_cloud_platform`` (the Google provider's: ``project``, ``key_path`` or
``keyfile_dict`` in its extras, read as that provider's hook reads them) → ``cloud_tpu``, with
``zone``, ``image`` and the backend's other settings in the extras; ``rlax_ray`` → ``ray``, its
host and port the Ray client address (``address`` in the extras: any address ``ray.init``
takes); ``rlax_local`` → ``local``. Without that Connection the environment decides
(``RLAX_BACKEND``, ``RLAX_BACKEND_SETTINGS`` as JSON): the fallback for tests and the local
docker-compose stack."""

from __future__ import annotations

import json
import os
from typing import Any

from airflow.sdk import BaseHook

from rlax_tasks.compute import setting_names
from rlax_tasks.plan.slices import PlanError

CONN_ID_ENV = "RLAX_COMPUTE_CONN_ID"
DEFAULT_CONN_ID = "rlax_compute"
GOOGLE_CONN_TYPE = "google_cloud_platform"
RAY_CONN_TYPE = "rlax_ray"
LOCAL_CONN_TYPE = "rlax_local"
RAY_CLIENT_PORT = 10001  # the Ray client server's default port (ray://host:10001)
# the Google provider's extras, unprefixed or with its old prefix
_GOOGLE_PREFIX = "extra__google_cloud_platform__"
_GOOGLE_KEYS = {"project": "project", "key_path": "credentials_file",
                "keyfile_dict": "credentials_info"}  # fmt: skip


def compute_conn_id() -> str:
    """The id of the compute Connection: RLAX_COMPUTE_CONN_ID, else ``rlax_compute``."""
    return os.environ.get(CONN_ID_ENV, "").strip() or DEFAULT_CONN_ID


def env_backend(run_root: str) -> tuple[str, dict[str, Any]]:
    """The fallback without a Connection: RLAX_BACKEND (default local) and RLAX_BACKEND_SETTINGS
    (a JSON object), plus ``run_root``."""
    name = os.environ.get("RLAX_BACKEND", "").strip() or "local"
    text = os.environ.get("RLAX_BACKEND_SETTINGS", "").strip()
    try:
        settings = json.loads(text) if text else {}
    except ValueError as e:
        raise PlanError(f"RLAX_BACKEND_SETTINGS is not a JSON object: {e}") from None
    if not isinstance(settings, dict):
        raise PlanError("RLAX_BACKEND_SETTINGS must be a JSON object")
    return name, {**settings, "run_root": run_root}


def backend_from_connection(conn: Any) -> tuple[str, dict[str, Any]]:
    """(backend name, settings without run_root) of a compute Connection; PlanError names the
    Connection and the field it cannot use."""
    extra = dict(conn.extra_dejson or {})
    where = f"Connection {conn.conn_id!r}"
    if conn.conn_type == GOOGLE_CONN_TYPE:
        keys = setting_names("cloud_tpu") - {"run_root"}
        settings: dict[str, Any] = {}
        for key, value in extra.items():
            plain = key.removeprefix(_GOOGLE_PREFIX)
            if plain in _GOOGLE_KEYS:
                if value not in (None, ""):
                    settings[_GOOGLE_KEYS[plain]] = value
            elif plain in keys:
                settings[plain] = value
            elif key.startswith(_GOOGLE_PREFIX) or plain in ("scope", "num_retries"):
                continue  # the Google provider's own fields: not the TPU backend's
            else:
                raise PlanError(
                    f"{where}: extra {key!r} is not a cloud_tpu setting; known: {sorted(keys)}"
                )
        if isinstance(settings.get("credentials_info"), str):
            try:
                settings["credentials_info"] = json.loads(settings["credentials_info"])
            except ValueError as e:
                raise PlanError(f"{where}: keyfile_dict is not JSON: {e}") from None
        return "cloud_tpu", settings
    if conn.conn_type in (RAY_CONN_TYPE, LOCAL_CONN_TYPE):
        name = "ray" if conn.conn_type == RAY_CONN_TYPE else "local"
        keys = setting_names(name) - {"run_root"}
        unknown = sorted(set(extra) - keys)
        if unknown:
            raise PlanError(f"{where}: extra {unknown} not {name} settings; known: {sorted(keys)}")
        if name == "ray" and not extra.get("address") and conn.host:
            extra["address"] = f"ray://{conn.host}:{conn.port or RAY_CLIENT_PORT}"
        return name, extra
    raise PlanError(
        f"{where}: connection type {conn.conn_type!r} names no compute backend; use "
        f"{GOOGLE_CONN_TYPE} (cloud_tpu), {RAY_CONN_TYPE} (ray) or {LOCAL_CONN_TYPE} (local)"
    )


def _connection(conn_id: str) -> Any | None:
    """The Connection ``conn_id`` (environment, secrets backend or metadata DB), None if none."""
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None


def compute_backend(run_root: str) -> tuple[str, dict[str, Any]]:
    """(backend name, settings for ``rlax_tasks.compute.get_backend``) of a task that runs now:
    the compute Connection's, else the environment's (``env_backend``), with ``run_root``."""
    conn = _connection(compute_conn_id())
    if conn is None:
        return env_backend(run_root)
    name, settings = backend_from_connection(conn)
    return name, {**settings, "run_root": run_root}


class _ComputeHook(BaseHook):
    """A compute Connection as an Airflow hook: ``get_conn()`` gives (backend name, settings
    without run_root). Registered as the connection types below (``provider_info``), so the
    Airflow UI offers them with their fields."""

    conn_name_attr = "rlax_compute_conn_id"
    default_conn_name = DEFAULT_CONN_ID

    def __init__(self, rlax_compute_conn_id: str = DEFAULT_CONN_ID) -> None:
        super().__init__()
        self.rlax_compute_conn_id = rlax_compute_conn_id

    def get_conn(self) -> tuple[str, dict[str, Any]]:
        return backend_from_connection(self.get_connection(self.rlax_compute_conn_id))


class RayClusterHook(_ComputeHook):
    """``rlax_ray``: a Ray cluster (the head's host and client port, or an ``address`` extra)."""

    conn_type = RAY_CONN_TYPE
    hook_name = "RLAX compute: Ray cluster"

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {
            "hidden_fields": ["schema", "login", "password"],
            "relabeling": {"host": "Ray head host", "port": f"Ray client port ({RAY_CLIENT_PORT})"},
            "placeholders": {"extra": '{"namespace": "rlax", "cpus_per_host": 1}'},
        }


class LocalComputeHook(_ComputeHook):
    """``rlax_local``: every job a process of the Airflow worker's host."""

    conn_type = LOCAL_CONN_TYPE
    hook_name = "RLAX compute: local processes"

    @classmethod
    def get_ui_field_behaviour(cls) -> dict[str, Any]:
        return {"hidden_fields": ["host", "port", "schema", "login", "password"]}
