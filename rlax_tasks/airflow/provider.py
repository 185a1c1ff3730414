"""Airflow's provider record of this package (entry point ``apache_airflow_provider``): the
compute connection types (``rlax_tasks.airflow.compute_connection``), listed in the UI's
connection form. Imports nothing: Airflow reads it while it starts."""

from __future__ import annotations

from typing import Any

_HOOKS = "rlax_tasks.airflow.compute_connection"


def provider_info() -> dict[str, Any]:
    """The provider record (Airflow's provider_info schema)."""
    return {
        "package-name": "rlax-tasks",
        "name": "RLAX",
        "description": "RL post-training of LLMs in JAX: compute backends as Connections.",
        "versions": ["0.1.0"],
        "connection-types": [
            {"connection-type": "rlax_ray", "hook-class-name": f"{_HOOKS}.RayClusterHook"},
            {"connection-type": "rlax_local", "hook-class-name": f"{_HOOKS}.LocalComputeHook"},
        ],
    }
