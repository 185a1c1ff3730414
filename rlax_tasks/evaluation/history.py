"""A run's evaluation history, one row per nightly evaluation in ``<run>/eval/history.jsonl``, so
held-out pass@k can be followed night after night (the dashboard shows it). A row: {"date",
"time", "version", "dag_run_id", "prompts", "pass@1", ..., "mean_reward", ...}. JAX-free: the
Airflow tasks that write it and the dashboard that reads it stay light."""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from typing import Any

from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

log = logging.getLogger(__name__)


def read_history(run_dir: str) -> list[dict[str, Any]]:
    """The rows of the run's history, oldest first; a torn line is skipped; [] when none."""
    return storage.read_jsonl(run_paths(run_dir).eval_history)


def evaluated_versions(run_dir: str) -> list[int]:
    """The weight versions with an ``eval/v<N>/results.json`` (local or gs://), ascending."""
    paths = run_paths(run_dir)
    versions = [int(d[1:]) for d in storage.list_children(paths.eval)
                if d.startswith("v") and d[1:].isdigit()]  # fmt: skip
    return sorted(v for v in versions if storage.exists(paths.eval_results(v)))


def read_overall(run_dir: str, version: int) -> dict[str, Any]:
    """The "overall" scores (pass@k, mean_reward...) of eval/v<version>/results.json; {} when
    missing or unreadable."""
    try:
        results = json.loads(storage.read_bytes(run_paths(run_dir).eval_results(version)))
        return dict(results["models"][0]["overall"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return {}


def history_row(
    results: dict[str, Any], version: int, dag_run_id: str | None, now: float
) -> dict[str, Any]:
    """The history row of one `rlax eval` results.json (its first model's overall metrics)."""
    models = results.get("models") or [{}]
    overall = models[0].get("overall") or {}
    return {
        "date": dt.datetime.fromtimestamp(now, dt.UTC).date().isoformat(),
        "time": now,
        "version": version,
        "dag_run_id": dag_run_id,
        **{k: v for k, v in overall.items() if isinstance(v, int | float) or v is None},
    }


def append_evaluation(
    run_dir: str, version: int, dag_run_id: str | None = None, now: float | None = None
) -> dict[str, Any] | None:
    """Appends the evaluation of weight ``version`` (eval/v<version>/results.json) to the run's
    history and returns the row; None when that evaluation wrote no results. Recording the same
    version for the same DAG run again (a retried task) changes nothing."""
    paths = run_paths(run_dir)
    try:
        results = json.loads(storage.read_bytes(paths.eval_results(version)))
    except FileNotFoundError:
        log.warning("%s: no results of version %d to record", run_dir, version)
        return None
    rows = read_history(run_dir)
    for row in rows:
        if row.get("version") == version and row.get("dag_run_id") == dag_run_id:
            return row
    row = history_row(results, version, dag_run_id, time.time() if now is None else now)
    body = "".join(json.dumps(r) + "\n" for r in [*rows, row])
    storage.write_bytes(paths.eval_history, body.encode())  # whole: gs:// objects do not append
    return row
