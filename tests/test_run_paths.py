"""rlax_tasks.rundir.paths: the run directory's layout (docs/design.md §7), spelled in one module
only."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from rlax_tasks.rundir import paths as layout
from rlax_tasks.rundir.paths import run_paths

REPO = pathlib.Path(__file__).resolve().parents[1]
OWNER = "rlax_tasks/rundir/paths.py"

# docs/design.md §7 (and the files the services and Airflow add): attribute -> path below the run
LAYOUT = {
    "config": "config.yaml",
    "checkpoints": "checkpoints",
    "weights": "weights",
    "snapshots": "snapshots",
    "snapshot_pointer": "snapshots/LATEST",
    "rollouts": "rollouts",
    "lineage": "lineage.jsonl",
    "metrics": "metrics.jsonl",
    "weight_sync": "weight_sync.jsonl",
    "tb": "tb",
    "eval": "eval",
    "eval_progress": "eval/progress.jsonl",
    "eval_history": "eval/history.jsonl",
    "heldout": "eval/heldout.jsonl",
    "heldout_scores": "eval/heldout_scores.jsonl",
    "report_json": "eval/report.json",
    "report_md": "eval/report.md",
    "status": "status.json",
    "workers": "workers.json",
    "services": "services",
    "logs": "logs",
    "done": "DONE",
    "slices": "slices",
    "notices": "notices.jsonl",
    "lock": "run.lock",
    "config_changes": "config_changes.jsonl",
    "airflow_log": "logs/airflow.log",
}


@pytest.mark.parametrize("root", ["/tmp/runs/r1", "/tmp/runs/r1/", "gs://bucket/runs/r1"])
def test_every_fixed_path_sits_where_design_7_puts_it(root):
    paths = run_paths(root)
    base = root.rstrip("/")
    fields = {f.name for f in dataclasses.fields(paths)} - {"root"}
    assert fields == set(LAYOUT)
    for name, rel in LAYOUT.items():
        assert getattr(paths, name) == f"{base}/{rel}", name
    assert paths.service("ps") == f"{base}/services/ps.json"
    assert paths.eval_dir(3) == f"{base}/eval/v3"
    assert paths.eval_results(3) == f"{base}/eval/v3/results.json"


@pytest.mark.parametrize("root", ["/tmp/runs", "gs://bucket/runs/"])
def test_base_evaluations_sit_in_the_run_root(root):
    assert layout.base_eval_dir(root, "ab12") == f"{root.rstrip('/')}/base-evals/ab12"


def test_run_paths_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        run_paths("/r").metrics = "/elsewhere"  # type: ignore[misc]


# the names no module but the owner may spell as a string literal
NAMES = [v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str) and "." in v] + [
    layout.CHECKPOINTS,
    layout.SNAPSHOTS,
    layout.SNAPSHOT_POINTER,
    layout.SERVICES,
]
# short names that are also ordinary words ("eval" the subcommand, "DONE" a trigger state):
# only joining them onto a path counts
JOINED = [layout.EVAL, layout.DONE, layout.WEIGHTS, layout.ROLLOUTS, layout.LOGS, layout.TB]
JOINED += [layout.SLICES, layout.BASE_EVALS]
# a module that spells one of the names for something that is not a run directory
ELSEWHERE = {"rlax_tasks/curation/report.py": {"report.json", "report.md"}}  # curation output


def _offences(text: str, allowed: set[str]) -> list[str]:
    out = [n for n in NAMES if n not in allowed and re.search(rf"[\"']{re.escape(n)}[\"']", text)]
    out += [n for n in JOINED if re.search(rf"join\([^)]*[\"']{re.escape(n)}[\"']", text)]
    return out


def test_no_module_but_run_paths_spells_a_run_file_name():
    sources = [p for d in ("rlax_tasks", "dags", "plugins") for p in (REPO / d).rglob("*.py")]
    assert len(sources) > 50
    found = {}
    for path in sources:
        rel = path.relative_to(REPO).as_posix()
        if rel == OWNER:
            continue
        offences = _offences(path.read_text(encoding="utf-8"), ELSEWHERE.get(rel, set()))
        if offences:
            found[rel] = offences
    assert not found, f"spell these through rlax_tasks.rundir.paths: {found}"


def test_the_check_catches_a_spelled_name():
    assert _offences('path = storage.join(run_dir, "metrics.jsonl")', set()) == ["metrics.jsonl"]
    assert _offences('done = os.path.join(run_dir, "DONE")', set()) == ["DONE"]
    assert _offences('state = "DONE"', set()) == []
