"""rlax_janitor: deletes slices that RLAX created and no active run owns any more."""

from __future__ import annotations

import logging

from airflow.sdk import Param, task

from rlax_tasks.airflow import factories as rc
from rlax_tasks.airflow import settings
from rlax_tasks.airflow.janitor import orphaned_slices
from rlax_tasks.airflow.params import silence_param

log = logging.getLogger(__name__)

DOC = """
### rlax_janitor
Every hour: lists the slices labelled `rlax-managed=true` under each run root of
`RLAX_RUN_ROOTS` (compute backend `RLAX_BACKEND`) and tears down those whose run is not active —
no `status.json`, a state other than provisioning/running, or no status update for
`grace_minutes`. `dry_run` only reports them. Teardown is idempotent, so a slice being deleted
by its own DAG at the same time is harmless.
"""


@rc.rlax_dag(
    "rlax_janitor",
    schedule="@hourly",
    tags=["maintenance"],
    doc_md=DOC,
    params={
        "grace_minutes": silence_param(30, "minutes"),
        "dry_run": Param(False, type="boolean", description="only list what would be deleted"),
    },
)
def rlax_janitor():
    @task
    def find_orphans(params: dict) -> list[dict]:
        from rlax_tasks.compute import MANAGED_LABEL, get_backend

        orphans = []
        for root in settings.run_roots():
            backend = get_backend(settings.backend_name(), **settings.backend_settings(root))
            slices = [
                {**h.to_dict(), "run_root": root}
                for h in backend.list_slices({MANAGED_LABEL: "true"})
            ]
            found = orphaned_slices(slices, grace_s=60.0 * params["grace_minutes"])
            log.info("%s: %d managed slice(s), %d orphaned", root, len(slices), len(found))
            orphans.extend(found)
        return orphans

    @task
    def delete(orphans: list[dict], params: dict) -> list[str]:
        from rlax_tasks.compute import get_backend

        deleted = []
        for handle in orphans:
            root = handle.pop("run_root")
            if params["dry_run"]:
                log.info("dry run: would delete slice %s", handle["name"])
                continue
            get_backend(settings.backend_name(), **settings.backend_settings(root)).teardown(handle)
            log.info("deleted orphaned slice %s", handle["name"])
            deleted.append(handle["name"])
        return deleted

    delete(find_orphans())


rlax_janitor()
