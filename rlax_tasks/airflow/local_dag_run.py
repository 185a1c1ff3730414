"""`rlax airflow train`: the rlax_train DAG run through Airflow on this machine.

Runs the real DAG file with ``dag.test()`` (Airflow's own local runner: every task in this
process, deferred triggers inline, SQLite metadata under ``AIRFLOW_HOME``), with the local
compute backend: the same tasks, operators, triggers and retries as on a deployment, no
scheduler or web server needed. For the UI, run ``airflow standalone`` (see the README).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

log = logging.getLogger(__name__)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def run_train_dag(
    conf: dict[str, Any],
    *,
    airflow_home: str,
    dags_folder: str,
    run_root: str,
) -> dict[str, Any]:
    """Runs rlax_train with Params ``conf``; returns {"state", "tasks", "run_dir", "eval"}."""
    if not os.path.isfile(os.path.join(dags_folder, "rlax_train.py")):
        raise FileNotFoundError(
            f"--dags-folder {dags_folder}: no rlax_train.py there (give the repository's dags/)"
        )
    if "airflow" in sys.modules and os.environ.get("AIRFLOW_HOME") != airflow_home:
        log.warning("Airflow was imported before its settings were made; they may not apply")
    _setup_env(airflow_home, dags_folder, run_root)
    os.makedirs(airflow_home, exist_ok=True)
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
    dag = bag.dags["rlax_train"]
    dag.params.validate()
    log.info("running DAG rlax_train with %s", json.dumps(conf))
    dr = dag.test(run_conf=conf)
    tasks = {
        ti.task_id + (f"[{ti.map_index}]" if ti.map_index >= 0 else ""): str(ti.state)
        for ti in dr.get_task_instances()
    }
    from rlax_tasks.run_paths import run_paths

    run_dir = os.path.join(run_root, conf["run_id"])
    out: dict[str, Any] = {"state": str(dr.state), "tasks": tasks, "run_dir": run_dir}
    paths = run_paths(run_dir)
    eval_root = paths.eval
    versions = sorted(
        int(d[1:])
        for d in (os.listdir(eval_root) if os.path.isdir(eval_root) else [])
        if d.startswith("v") and d[1:].isdigit()
    )
    if versions:
        path = paths.eval_results(versions[-1])
        try:
            with open(path) as f:
                out["eval"] = {"version": versions[-1], **json.load(f)["models"][0]["overall"]}
        except (OSError, ValueError, KeyError):
            pass
    return out


def _train_command(args: argparse.Namespace) -> int:
    import yaml

    from rlax_tasks.config import load_config

    overrides: dict[str, Any] = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected dotted.key=value")
        overrides[key] = yaml.safe_load(value)
    cfg = load_config(args.preset, dict(overrides))  # validates before Airflow starts
    steps = args.steps or cfg.trainer.total_steps
    if not steps:
        raise ValueError("give --steps (the preset has no trainer.total_steps)")
    run_root = os.path.abspath(args.run_root)
    conf = {
        "preset": args.preset,
        "steps": int(steps),
        "run_id": args.run_id,
        "run_root": run_root,
        "num_workers": cfg.workers.count,
        "reload_every": cfg.staleness.reload_every,
        "max_staleness": cfg.staleness.max_staleness,
        "overrides": overrides,
    }
    result = run_train_dag(
        conf,
        airflow_home=os.path.abspath(args.airflow_home),
        dags_folder=os.path.abspath(args.dags_folder),
        run_root=run_root,
    )
    print(f"rlax_train {result['state']}: {result['run_dir']}")
    for name, state in result["tasks"].items():
        print(f"  {name:<16} {state}")
    if "eval" in result:
        e = result["eval"]
        ks = ", ".join(f"{k} {v:.3f}" for k, v in e.items() if k.startswith("pass@"))
        print(f"held-out evaluation of weight version {e['version']}: {ks}")
    return 0 if result["state"] == "success" else 1


def add_airflow_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `rlax airflow train`."""
    p = sub.add_parser("airflow", help="run the RLAX DAGs through Airflow on this machine")
    cmds = p.add_subparsers(dest="airflow_command", required=True)
    t = cmds.add_parser(
        "train",
        help="run the rlax_train DAG end to end (dag.test, local backend, SQLite metadata)",
    )
    t.add_argument("--preset", default="tiny-arith", help="run-config preset (default tiny-arith)")
    t.add_argument("--steps", type=int, help="training steps (default: the preset's)")
    t.add_argument("--run-id", default="tiny-arith-airflow", help="same id = resume that run")
    t.add_argument("--run-root", default="runs", help="local directory of the runs")
    t.add_argument("--set", action="append", help="override a config field: dotted.key=value")
    t.add_argument(
        "--airflow-home", default=os.environ.get("AIRFLOW_HOME") or ".airflow",
        help="Airflow's home (metadata database, logs); default $AIRFLOW_HOME or ./.airflow",
    )  # fmt: skip
    t.add_argument(
        "--dags-folder", default=os.path.join(REPO, "dags"), help="the DAG files (repo's dags/)"
    )
    t.set_defaults(func=_train_command)
