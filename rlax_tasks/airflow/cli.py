"""`rlax airflow train`: the command that runs the rlax_train DAG through Airflow on this
machine (airflow/local_dag_run.py). Light to import: Airflow and the run's modules load when the
command runs."""

from __future__ import annotations

import argparse
import os
from typing import Any

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _positive_steps(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"--steps {text!r}: give a positive number of training steps")
    return value


def _train_command(args: argparse.Namespace) -> int:
    from rlax_tasks.airflow import local_dag_run  # the config, Airflow: when it runs

    overrides: dict[str, Any] = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected dotted.key=value")
        overrides[key] = yaml.safe_load(value)
    return local_dag_run.train_locally(
        args.preset,
        overrides,
        _positive_steps(args.steps),
        run_id=args.run_id,
        run_root=args.run_root,
        allow_config_change=args.allow_config_change,
        airflow_home=args.airflow_home,
        dags_folder=args.dags_folder,
        verbose=args.verbose,
    )


def add_airflow_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax airflow train`."""
    p = sub.add_parser("airflow", help="run the RLAX DAGs through Airflow on this machine")
    cmds = p.add_subparsers(dest="airflow_command", required=True)
    t = cmds.add_parser(
        "train",
        help="run the rlax_train DAG end to end (dag.test, local backend, SQLite metadata)",
    )
    t.add_argument("--preset", default="tiny-arith", help="run-config preset (default tiny-arith)")
    t.add_argument("--steps", help="training steps, a positive integer (default: the preset's)")
    t.add_argument(
        "--run-id", default=None, help="same id = resume that run (default: PRESET-airflow)"
    )
    t.add_argument("--run-root", default="runs", help="local directory of the runs")
    t.add_argument("--set", action="append", help="override a config field: dotted.key=value")
    t.add_argument(
        "--allow-config-change", action="store_true",
        help="resume --run-id with settings that change training (recorded per step)",
    )  # fmt: skip
    t.add_argument(
        "--airflow-home", default=os.environ.get("AIRFLOW_HOME") or ".airflow",
        help="Airflow's home (metadata database, logs); default $AIRFLOW_HOME or ./.airflow",
    )  # fmt: skip
    t.add_argument(
        "--dags-folder", default=os.path.join(REPO, "dags"), help="the DAG files (repo's dags/)"
    )
    t.set_defaults(func=_train_command)
