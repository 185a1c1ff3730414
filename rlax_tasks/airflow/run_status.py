"""run_dir/status.json: the state a DAG run records for its run (read by the dashboard, janitor).

{"state", "updated" (unix seconds), "dag_run_id", ...}; the DAGs add "dag_id" so that the
dashboard links the DAG run.
"""

from __future__ import annotations

import json
import time
from typing import Any

from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

# states of a run whose slices are in use (the janitor leaves them alone)
ACTIVE_STATES = ("provisioning", "running")


def write_status(run_dir: str, state: str, dag_run_id: str | None = None, **extra: Any) -> None:
    """Writes run_dir/status.json (read by the dashboard and the janitor): {"state", "updated",
    "dag_run_id", ...``extra``}; the DAGs add "dag_id" (the dashboard links the DAG run)."""
    record = {"state": state, "updated": time.time(), "dag_run_id": dag_run_id, **extra}
    storage.write_bytes(run_paths(run_dir).status, json.dumps(record).encode())


def read_status(run_dir: str) -> dict[str, Any] | None:
    """The run's status record, or None when there is none (or it cannot be read)."""
    try:
        data = json.loads(storage.read_bytes(run_paths(run_dir).status))
    except (FileNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None
