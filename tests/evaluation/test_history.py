"""A run's nightly evaluation history (eval/history.jsonl), as rlax_nightly_eval records it."""

from __future__ import annotations

import json
import os

from rlax_tasks.airflow import eval_planning as rc
from rlax_tasks.evaluation.history import append_evaluation, read_history
from rlax_tasks.rundir.paths import run_paths


def write_results(run_dir: str, version: int, pass_at_1: float) -> None:
    path = run_paths(run_dir).eval_results(version)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    overall = {"prompts": 10, "pass@1": pass_at_1, "pass@8": 0.9, "maj@1": None, "skipped": 0}
    with open(path, "w") as f:
        json.dump({"dataset": "d", "models": [{"name": "m", "overall": overall}]}, f)


def test_each_nightly_evaluation_appends_one_row(tmp_path):
    run = str(tmp_path / "run")
    write_results(run, 4, 0.4)
    night1 = 1748736000.0  # 2025-06-01 00:00 UTC
    row = append_evaluation(run, 4, "scheduled__2025-06-01", now=night1)
    assert row == {
        "date": "2025-06-01", "time": night1, "version": 4, "dag_run_id": "scheduled__2025-06-01",
        "prompts": 10, "pass@1": 0.4, "pass@8": 0.9, "maj@1": None, "skipped": 0,
    }  # fmt: skip
    # a retried task records nothing twice
    assert append_evaluation(run, 4, "scheduled__2025-06-01", now=night1 + 60) == row
    write_results(run, 9, 0.6)
    append_evaluation(run, 9, "scheduled__2025-06-02", now=night1 + 86400)
    rows = read_history(run)
    assert [(r["date"], r["version"], r["pass@1"]) for r in rows] == [
        ("2025-06-01", 4, 0.4),
        ("2025-06-02", 9, 0.6),
    ]
    # an evaluation that wrote nothing (its job failed) is not a row
    assert append_evaluation(run, 12, "scheduled__2025-06-03") is None
    assert len(read_history(run)) == 2


def test_the_nightly_dag_records_the_evaluations_that_succeeded(tmp_path):
    ok, failed = str(tmp_path / "ok"), str(tmp_path / "failed")
    write_results(ok, 3, 0.5)
    rows = rc.record_nightly_history(
        [{"run_dir": ok, "version": 3}, {"run_dir": failed, "version": 7}], "scheduled__x"
    )
    assert [(r["run_dir"], r["version"], r["pass@1"]) for r in rows] == [(ok, 3, 0.5)]
    assert [r["dag_run_id"] for r in read_history(ok)] == ["scheduled__x"]
    assert read_history(failed) == []
