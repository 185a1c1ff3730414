"""The janitor's rule: which managed slices belong to no active run (rlax_janitor tears them down).

A slice names its run by its run-id label and its backend's run root; a run is active while its
status.json says so and was updated within the grace period.
"""

from __future__ import annotations

import time
from typing import Any

from rlax_tasks.airflow.run_status import ACTIVE_STATES, read_status
from rlax_tasks.compute.types import RUN_ID_LABEL
from rlax_tasks.rundir import storage


def orphaned_slices(slices: list[dict[str, Any]], grace_s: float) -> list[dict[str, Any]]:
    """The slices (handle dicts) whose run is not active: no status.json, a state outside
    ACTIVE_STATES, or no status update within ``grace_s``. A slice records its run root and
    run id in its spec labels / handle root."""
    out = []
    now = time.time()
    for handle in slices:
        run_dir = slice_run_dir(handle)
        status = read_status(run_dir) if run_dir else None
        active = (
            status is not None
            and status.get("state") in ACTIVE_STATES
            and now - float(status.get("updated") or 0.0) <= grace_s
        )
        if not active:
            out.append(handle)
    return out


def slice_run_dir(handle: dict[str, Any]) -> str | None:
    """run_root/<run_id> of a slice, from the handle's label and its backend's run root
    (annotated by the janitor as "run_root"), or None when unknown."""
    run_id = (handle.get("spec") or {}).get("labels", {}).get(RUN_ID_LABEL)
    run_root = handle.get("run_root")
    if not run_id or not run_root:
        return None
    return storage.join(run_root, run_id)
