"""The DAGs' environment settings: run roots, the compute backend of a task running now, and
the watchers' timings (RLAX_RUN_ROOT, RLAX_RUN_ROOTS, RLAX_SIBLING_GRACE_S,
RLAX_POLL_INTERVAL_S; docs/ (Airflow)). Read when called, never cached at import."""

from __future__ import annotations

import os
from typing import Any

from rlax_tasks.airflow.compute_connection import compute_backend


def default_run_root() -> str:
    """RLAX_RUN_ROOT, else ``runs``."""
    return os.environ.get("RLAX_RUN_ROOT", "").strip() or "runs"


def run_roots() -> list[str]:
    """Run roots scanned by the nightly evaluation and the janitor."""
    text = os.environ.get("RLAX_RUN_ROOTS", "")
    return [r.strip() for r in text.split(",") if r.strip()] or [default_run_root()]


def backend_name() -> str:
    """The compute backend of a task running now (``compute_connection.compute_backend``)."""
    return compute_backend(default_run_root())[0]


def backend_settings(run_root: str) -> dict[str, Any]:
    """Settings for ``rlax_tasks.compute.get_backend`` of a task running now, with ``run_root``:
    the compute Connection's, else RLAX_BACKEND_SETTINGS."""
    return compute_backend(run_root)[1]


def sibling_grace_s() -> float:
    """How long a service's watcher waits for a failed sibling's retry before it fails too."""
    return float(os.environ.get("RLAX_SIBLING_GRACE_S") or 600)


def poll_interval(kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` with RLAX_POLL_INTERVAL_S as the operator's poll interval, where it is set and the
    task names none (unset: the operators' own defaults)."""
    text = os.environ.get("RLAX_POLL_INTERVAL_S", "").strip()
    return {"poll_interval_s": float(text), **kw} if text else kw
