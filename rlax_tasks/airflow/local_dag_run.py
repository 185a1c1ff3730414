"""The rlax_train DAG run through Airflow on this machine (the command, `rlax airflow train`:
airflow/cli.py).

Runs the real DAG file with ``dag.test()`` (every task in this process, triggers inline, SQLite
metadata under ``AIRFLOW_HOME``) on the local backend; the terminal shows ``dag_watch``'s lines
and a before/after pass@k table, Airflow's own logs go to the run's ``logs/airflow.log``."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from typing import Any, TextIO

from rlax_tasks.airflow.dag_watch import DagRunWatcher, metadata_task_states
from rlax_tasks.config import load_config
from rlax_tasks.evaluation.history import evaluated_versions, read_overall
from rlax_tasks.run.progress import format_duration
from rlax_tasks.rundir.paths import run_paths
from rlax_tasks.trainer.scalar_export import log_scalars

log = logging.getLogger(__name__)

DAG_ID = "rlax_train"
SCORES = ("pass@", "maj@", "mean_reward")  # the evaluation's scores sent to TensorBoard


def _setup_env(airflow_home: str, dags_folder: str, run_root: str) -> None:
    """Airflow reads its settings once, at import: set them first."""
    plugins = os.path.join(os.path.dirname(dags_folder), "plugins")
    os.environ["AIRFLOW_HOME"] = airflow_home
    os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = dags_folder
    if os.path.isdir(plugins):
        os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", plugins)
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
    os.environ["RLAX_RUN_ROOT"] = run_root
    os.environ.setdefault("RLAX_RUN_ROOTS", run_root)


def _check_dags_folder(dags_folder: str) -> None:
    if not os.path.isfile(os.path.join(dags_folder, "rlax_train.py")):
        raise FileNotFoundError(
            f"--dags-folder {dags_folder}: no rlax_train.py there (give the repository's dags/)"
        )


def run_train_dag(
    conf: dict[str, Any],
    *,
    airflow_home: str,
    dags_folder: str,
    run_root: str,
    out: TextIO | None = None,
    airflow_log: str | None = None,
) -> dict[str, Any]:
    """Runs rlax_train with Params ``conf``; returns {"state", "tasks", "run_dir", "eval", "before",
    "training_seconds"} ("eval"/"before": the newest and the v0 evaluation, when present).
    ``out``: where progress lines are printed while it runs (None: nowhere); ``airflow_log``: the
    file Airflow's logs go to (for a failed task's last lines)."""
    _check_dags_folder(dags_folder)
    if "airflow" in sys.modules and os.environ.get("AIRFLOW_HOME") != airflow_home:
        log.warning("Airflow was imported before its settings were made; they may not apply")
    _setup_env(airflow_home, dags_folder, run_root)
    os.makedirs(airflow_home, exist_ok=True)
    # lazy: Airflow reads its settings when imported, so only after _setup_env
    from airflow.dag_processing.dagbag import DagBag
    from airflow.utils import db

    log.info("Airflow metadata database under %s", airflow_home)
    db.initdb()  # creates or upgrades the SQLite database; a no-op when current
    bag = DagBag(dag_folder=dags_folder)
    if bag.import_errors:
        errors = "; ".join(
            f"{path}: {text.strip().splitlines()[-1]}" for path, text in bag.import_errors.items()
        )
        raise ValueError(f"the DAG files do not import: {errors}")
    dag = bag.dags[DAG_ID]
    dag.params.validate()
    run_dir = os.path.join(run_root, conf["run_id"])
    watcher = None
    if out is not None:
        states = metadata_task_states(DAG_ID)
        watcher = DagRunWatcher(out, states, run_dir, int(conf["steps"]), airflow_log)
        watcher.start()
    log.info("running DAG rlax_train with %s", json.dumps(conf))
    try:
        dr = dag.test(run_conf=conf)
    finally:
        if watcher is not None:
            watcher.stop()
    tasks = {
        ti.task_id + (f"[{ti.map_index}]" if ti.map_index >= 0 else ""): str(ti.state)
        for ti in dr.get_task_instances()
    }
    result: dict[str, Any] = {"state": str(dr.state), "tasks": tasks, "run_dir": run_dir}
    if watcher is not None:
        result["training_seconds"] = watcher.training_seconds
    versions = evaluated_versions(run_dir)
    if versions and versions[-1] > 0:
        result["eval"] = {"version": versions[-1], **read_overall(run_dir, versions[-1])}
    if 0 in versions:
        result["before"] = {"version": 0, **read_overall(run_dir, 0)}
    for key in ("before", "eval"):  # TensorBoard's tb/eval/ ("eval/pass@k"); once per version
        if key in result:
            scores = {k: v for k, v in result[key].items() if k.startswith(SCORES)}
            log_scalars(run_dir, result[key]["version"], scores, "eval")
    return result


class _QuietTerminal:
    """Sends everything Python writes (Airflow's logs and task logs, warnings) to ``path`` while
    active; the command keeps the terminal stream for its own lines. ``sys.stdout``/``sys.stderr``
    are replaced before Airflow configures its handlers, and handlers already on the terminal are
    pointed at the file. Subprocesses (the run's jobs) have log files of their own."""

    def __init__(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.path = path
        # stays open to the end of the process: Airflow's handlers keep writing to it at exit
        self.file = open(path, "a", encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115
        self._saved: list[tuple[logging.StreamHandler, Any]] = []

    def __enter__(self) -> _QuietTerminal:
        self._streams = (sys.stdout, sys.stderr)
        for handler in _stream_handlers():
            if handler.stream in self._streams:
                self._saved.append((handler, handler.setStream(self.file)))
        sys.stdout = sys.stderr = self.file
        return self

    def __exit__(self, *exc: object) -> None:
        sys.stdout, sys.stderr = self._streams
        for handler, stream in self._saved:
            handler.setStream(stream)
        self.file.flush()


def _stream_handlers() -> list[logging.StreamHandler]:
    loggers = [logging.getLogger()] + [
        x for x in logging.Logger.manager.loggerDict.values() if isinstance(x, logging.Logger)
    ]
    return [
        h
        for lg in loggers
        for h in lg.handlers
        if type(h) is logging.StreamHandler  # not FileHandler (a subclass)
    ]


def _summary(result: dict[str, Any], ks: list[int], run_root: str) -> str:
    """The end-of-run table: held-out pass@k before/after, training time, where things are."""
    before, after = result.get("before", {}), result.get("eval", {})

    def score(row: dict[str, Any], key: str) -> str:
        v = row.get(key)
        return f"{v:.3f}" if isinstance(v, int | float) else "-"

    head_after = f"after (v{after['version']})" if after else "after"
    rows = [("", "before (v0)", head_after)]
    rows += [(f"held-out pass@{k}", score(before, f"pass@{k}"), score(after, f"pass@{k}"))
             for k in ks]  # fmt: skip
    seconds = result.get("training_seconds")
    report = run_paths(result["run_dir"]).report_md
    rows += [
        ("training time", format_duration(seconds) if seconds is not None else "-", ""),
        ("report", report if os.path.isfile(report) else "-", ""),
        ("dashboard", "http://localhost:8080/rlax/ (airflow standalone: docs/operations.md)", ""),
        ("tensorboard", f"tensorboard --logdir {run_root}", ""),
    ]
    return "\n".join(f"  {a:<18} {b:<14} {c}".rstrip() for a, b, c in rows)


def train_locally(
    preset: str,
    overrides: dict[str, Any],
    steps: int | None,
    *,
    run_id: str | None,
    run_root: str,
    allow_config_change: bool,
    airflow_home: str,
    dags_folder: str,
    verbose: bool,
) -> int:
    """Runs the rlax_train DAG for ``preset`` with ``overrides`` to ``steps`` (None: the preset's
    trainer.total_steps) through Airflow on this machine and prints the end-of-run table; exit 0
    when the DAG run succeeded, else 1. The config is validated before Airflow starts."""
    cfg = load_config(preset, dict(overrides))  # validates before Airflow starts
    steps = steps or cfg.trainer.total_steps
    if not steps:
        raise ValueError("give --steps (the preset has no trainer.total_steps)")
    run_root = os.path.abspath(run_root)
    run_id = run_id or f"{preset}-airflow"
    conf = {
        "preset": preset,
        "steps": int(steps),
        "run_id": run_id,
        "run_root": run_root,
        "num_workers": cfg.workers.count,
        "reload_every": cfg.staleness.reload_every,
        "max_staleness": cfg.staleness.max_staleness,
        "overrides": overrides,
        "allow_config_change": bool(allow_config_change),
    }
    dags_folder = os.path.abspath(dags_folder)
    _check_dags_folder(dags_folder)
    run_dir = os.path.join(run_root, run_id)
    airflow_log = run_paths(run_dir).airflow_log
    terminal = sys.stdout
    print(f"rlax airflow train: run {run_id}, {steps} steps, in {run_dir}", flush=True)
    quiet = None if verbose else _QuietTerminal(airflow_log)
    if quiet is not None:
        print(f"Airflow's logs and the task logs: {airflow_log} (-v: here)", flush=True)
    with quiet or contextlib.nullcontext():
        result = run_train_dag(
            conf,
            airflow_home=os.path.abspath(airflow_home),
            dags_folder=dags_folder,
            run_root=run_root,
            out=terminal,
            airflow_log=airflow_log if quiet is not None else None,
        )
    print(f"rlax_train {result['state']}: {result['run_dir']}")
    print(_summary(result, list(cfg.eval.ks), run_root), flush=True)
    return 0 if result["state"] == "success" else 1
