"""What the RLAX dashboard knows about runs: ``<run_id>/`` children of run roots (local or gs://)
holding ``config.yaml`` or ``metrics.jsonl`` (docs/design.md §7), read through rundir.storage, never
written. A run's state comes from the rlax_train DAG's ``status.json`` (which links its DAG run),
else is inferred: "finished" with eval/report.json, "running" when metrics.jsonl changed within
``active_window_s``, "stopped" otherwise, "pending" before the first step."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time
import urllib.parse
from typing import Any

import yaml

from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import EVAL_RESULTS, run_paths

log = logging.getLogger(__name__)

RUN_ROOTS_ENV = "RLAX_RUN_ROOTS"
DEFAULT_RUN_ROOTS = ("runs",)
ACTIVE_WINDOW_S = 900.0
RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_EVAL_VERSION_RE = re.compile(r"^v(\d+)$")
_PASS_RE = re.compile(r"^pass@(\d+)$")
# metrics.jsonl keys the dashboard plots (see the module docstring)
METRIC_KEYS = ("reward_mean", "staleness_mean", "weight_sync_s")
# the DAG whose runs wrote status.json before the record named its DAG
DEFAULT_DAG_ID = "rlax_train"
# config keys that always differ between runs and say nothing (the runs are named anyway)
_SAME_BY_NAME = ("run_id",)


def run_roots_from_env(value: str | None = None) -> list[str]:
    """The run roots to list: ``RLAX_RUN_ROOTS`` (comma-separated local dirs / gs:// URIs)."""
    text = os.environ.get(RUN_ROOTS_ENV, "") if value is None else value
    roots = [r.strip() for r in text.split(",") if r.strip()]
    return roots or list(DEFAULT_RUN_ROOTS)


@dataclasses.dataclass
class RunSummary:
    """One row of the runs table."""

    root_index: int
    run_root: str
    run_id: str
    state: str
    step: int | None
    reward_mean: float | None
    pass_at: dict[str, float]
    updated: float | None
    dag_run_id: str | None = None
    dag_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "dag_run_path": self.dag_run_path}

    @property
    def dag_run_path(self) -> str | None:
        """The run's DAG run in the Airflow UI, relative to the UI's root (Airflow 3's route
        ``dags/<dag_id>/runs/<run_id>``); None when no DAG started it."""
        if not self.dag_run_id:
            return None
        quote = urllib.parse.quote
        return f"dags/{quote(self.dag_id or DEFAULT_DAG_ID, safe='')}/runs/" + quote(
            self.dag_run_id, safe=""
        )


@dataclasses.dataclass
class RunSeries:
    """Per-step series of one run, each a list of (x, y) points sorted by x."""

    reward: list[tuple[int, float]]
    staleness: list[tuple[int, float]]
    weight_sync: list[tuple[int, float]]
    pass_at: dict[str, list[tuple[int, float]]]  # "pass@1" -> [(version or step, value)]
    # "pass@1" -> [(training seconds when that version was produced, value)]
    pass_at_time: dict[str, list[tuple[float, float]]] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "reward": self.reward,
            "staleness": self.staleness,
            "weight_sync": self.weight_sync,
            "pass_at": self.pass_at,
            "pass_at_time": self.pass_at_time,
        }


# --------------------------------------------------------------------------- reading
def _read_text(path: str) -> str | None:
    try:
        return storage.read_bytes(path).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return None


def _read_json(path: str) -> Any:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        log.warning("dashboard: %s is not valid JSON; ignored", path)
        return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _step(row: dict[str, Any]) -> int | None:
    s = row.get("step")
    return s if isinstance(s, int) and not isinstance(s, bool) else None


def _points(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) for every row with an integer step and a finite ``key``; last row wins."""
    by_step: dict[int, float] = {}
    for row in rows:
        s, v = _step(row), _number(row.get(key))
        if s is not None and v is not None:
            by_step[s] = v
    return sorted(by_step.items())


def modified_time(path: str) -> float | None:
    """Unix seconds of the last change of ``path`` (None when it does not exist)."""
    try:
        info = storage.stat(path)
    except Exception:  # noqa: BLE001 - an unreachable bucket or a permission error: no timestamp
        return None
    return info.updated if info is not None else None


# --------------------------------------------------------------------------- runs
def run_dir(run_root: str, run_id: str) -> str:
    """run_root/<run_id>, refusing ids that could escape the root."""
    if not RUN_ID_RE.match(run_id):
        raise ValueError(f"run id {run_id!r}: must be letters, digits, '_', '.', '-'")
    return storage.join(run_root, run_id)


def list_run_ids(run_root: str) -> list[str]:
    """Children of ``run_root`` that hold a run (config.yaml or metrics.jsonl)."""
    out = []
    for name in storage.list_children(run_root):
        if not RUN_ID_RE.match(name):
            continue
        paths = run_paths(storage.join(run_root, name))
        if storage.exists(paths.config) or storage.exists(paths.metrics):
            out.append(name)
    return out


def read_series(path: str, metrics: list[dict[str, Any]] | None = None) -> RunSeries:
    """Reward, staleness, weight-sync time and pass@k series of the run at ``path``
    (``metrics``: its metrics.jsonl rows when the caller has read them already)."""
    paths = run_paths(path)
    if metrics is None:
        metrics = storage.read_jsonl(paths.metrics)
    reward = _points(metrics, "reward_mean")
    staleness = _points(metrics, "staleness_mean")
    if not staleness:
        lineage = storage.read_jsonl(paths.lineage)
        rows = []
        for r in lineage:
            versions = [v for v in r.get("rollout_versions") or [] if _number(v) is not None]
            version = _number(r.get("version"))
            if _step(r) is not None and versions and version is not None:
                rows.append(
                    {"step": r["step"], "v": sum(version - v for v in versions) / len(versions)}
                )
        staleness = _points(rows, "v")
    weight_sync = _points(metrics, "weight_sync_s")
    if not weight_sync:
        weight_sync = _points(storage.read_jsonl(paths.weight_sync), "push_s")
    pass_at = _pass_at_series(path, metrics)
    seconds = training_seconds(metrics)
    pass_at_time = {
        k: [(seconds[x], v) for x, v in pts if x in seconds] for k, pts in pass_at.items()
    }
    return RunSeries(reward, staleness, weight_sync, pass_at, pass_at_time)


def training_seconds(metrics: list[dict[str, Any]]) -> dict[int, float]:
    """{step: seconds from the start of training until that step was applied} from the
    metrics' wall-clock ``time`` (the start: the first step's time less its ``step_time_s``);
    step 0, the starting weights, is at 0. {} when the metrics carry no times."""
    times = {}
    for row in metrics:
        s, t = _step(row), _number(row.get("time"))
        if s is not None and t is not None:
            times[s] = (t, _number(row.get("step_time_s")) or 0.0)
    if not times:
        return {}
    first_time, first_duration = times[min(times)]
    start = first_time - first_duration
    return {0: 0.0, **{s: max(0.0, t - start) for s, (t, _) in sorted(times.items())}}


def _eval_overall(path: str) -> dict[int, dict[str, Any]]:
    """{version: overall metrics} of the run's ``rlax eval`` outputs (eval/v<version>/)."""
    eval_dir = run_paths(path).eval
    out = {}
    for name in storage.list_children(eval_dir):
        m = _EVAL_VERSION_RE.match(name)
        if not m:
            continue
        results = _read_json(storage.join(eval_dir, name, EVAL_RESULTS))
        models = results.get("models") if isinstance(results, dict) else None
        if isinstance(models, list) and models and isinstance(models[0], dict):
            overall = models[0].get("overall")
            if isinstance(overall, dict):
                out[int(m.group(1))] = overall
    return out


def _pass_at_series(path: str, metrics: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, dict[int, float]] = {}

    def add(x: int, values: Any) -> None:
        if not isinstance(values, dict):
            return
        for key, value in values.items():
            v = _number(value)
            if _PASS_RE.match(str(key)) and v is not None:
                series.setdefault(str(key), {})[x] = v

    for row in metrics:
        if _step(row) is not None:
            add(row["step"], row)
    paths = run_paths(path)
    report = _read_json(paths.report_json)
    if isinstance(report, dict):
        before, after = report.get("before"), report.get("after")
        if isinstance(before, dict):
            add(int(_number(before.get("version")) or 0), before)
        if isinstance(after, dict):
            last = max((s for s in (_step(r) for r in metrics) if s is not None), default=0)
            version = _number(after.get("version"))
            add(int(version) if version is not None else last, after)
    for row in storage.read_jsonl(paths.eval_progress):  # eval.every_steps
        version = _number(row.get("version")) if isinstance(row, dict) else None
        if version is not None:
            add(int(version), row)
    for version, overall in _eval_overall(path).items():
        add(version, overall)
    return {k: sorted(v.items()) for k, v in sorted(series.items())}


def pass_key_order(key: str) -> tuple[int, str]:
    """Sort key of metric names: pass@1, pass@8, ..., then the others by name."""
    m = _PASS_RE.match(key)
    return (int(m.group(1)), "") if m else (1 << 30, key)


def _scores(values: dict[str, Any]) -> dict[str, float]:
    """The pass@k and mean reward of an evaluation's numbers."""
    out = {}
    for key, value in values.items():
        v = _number(value)
        if v is not None and (_PASS_RE.match(str(key)) or key == "mean_reward"):
            out[str(key)] = v
    return out


def before_after(path: str, metrics: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The held-out numbers of the starting weights and of the newest evaluated weights:
    {"before": {"version": 0, "pass@1": ...} | None, "after": {...} | None}. Before: eval/v0
    (the DAG's base evaluation), else eval/report.json's ``before`` (`rlax run`); after: the
    newest of eval/v<N> (N > 0: the DAG's final evaluation, the nightly ones) and the report's
    ``after``."""
    if metrics is None:
        metrics = storage.read_jsonl(run_paths(path).metrics)
    evals = _eval_overall(path)
    report = _read_json(run_paths(path).report_json)
    report = report if isinstance(report, dict) else {}
    before = None
    if 0 in evals:
        before = {"version": 0, **_scores(evals[0])}
    elif isinstance(report.get("before"), dict):
        version = _number(report["before"].get("version"))
        before = {"version": int(version or 0), **_scores(report["before"])}
    candidates = [(v, 1, _scores(o)) for v, o in evals.items() if v > 0]
    if isinstance(report.get("after"), dict):
        version = _number(report["after"].get("version"))
        if version is None:
            version = max((s for s in (_step(r) for r in metrics) if s is not None), default=0)
        candidates.append((int(version), 0, _scores(report["after"])))
    after = None
    if candidates:  # the newest version; at a tie, the `rlax eval` output
        version, _, scores = max(candidates, key=lambda c: (c[0], c[1]))
        after = {"version": version, **scores}
    return {"before": before, "after": after}


def read_config(path: str) -> dict[str, Any] | None:
    """The run's config.yaml as plain data (None when missing or unreadable)."""
    text = _read_text(run_paths(path).config)
    if text is None:
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        log.warning("dashboard: %s is not valid YAML; ignored", run_paths(path).config)
        return None
    return data if isinstance(data, dict) else None


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as dotted keys ("staleness.reload_every"); lists of mappings by index
    ("datasets[0].source.path"); other lists are values."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and any(isinstance(item, dict) for item in value):
        out = {}
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


_MISSING = object()


def config_differences(configs: list[dict[str, Any] | None]) -> list[tuple[str, list[Any]]]:
    """The flattened keys on which ``configs`` differ, each with every config's value (None
    where a config lacks the key); run_id aside. Sorted by key."""
    flat = [flatten(c or {}) for c in configs]
    keys = sorted({k for f in flat for k in f} - set(_SAME_BY_NAME))
    out = []
    for key in keys:
        values = [f.get(key, _MISSING) for f in flat]
        if any(v != values[0] for v in values[1:]):
            out.append((key, [None if v is _MISSING else v for v in values]))
    return out


def summarize(root_index: int, run_root: str, run_id: str, active_window_s: float) -> RunSummary:
    """The table row of one run: state, last step, last reward, newest pass@k."""
    path = run_dir(run_root, run_id)
    paths = run_paths(path)
    metrics_path = paths.metrics
    metrics = storage.read_jsonl(metrics_path)
    series = read_series(path, metrics)
    step = max((s for s in (_step(r) for r in metrics) if s is not None), default=None)
    updated = modified_time(metrics_path)
    status = _read_json(paths.status)
    dag_run_id = dag_id = None
    if isinstance(status, dict) and isinstance(status.get("state"), str):
        state = status["state"]
        dag_run_id = status.get("dag_run_id") if isinstance(status.get("dag_run_id"), str) else None
        dag_id = status.get("dag_id") if isinstance(status.get("dag_id"), str) else None
        updated = max(filter(None, [updated, _number(status.get("updated"))]), default=None)
    elif storage.exists(paths.report_json):
        state = "finished"
    elif step is None:
        state = "pending"
    elif updated is not None and time.time() - updated <= active_window_s:
        state = "running"
    else:
        state = "stopped"
    newest = {k: pts[-1][1] for k, pts in series.pass_at.items() if pts}
    return RunSummary(
        root_index,
        run_root,
        run_id,
        state,
        step,
        series.reward[-1][1] if series.reward else None,
        newest,
        updated,
        dag_run_id,
        dag_id,
    )


def list_runs(roots: list[str], active_window_s: float = ACTIVE_WINDOW_S) -> list[RunSummary]:
    """Every run under ``roots``, newest change first; an unreadable root is logged, not fatal."""
    out = []
    for i, root in enumerate(roots):
        try:
            ids = list_run_ids(root)
        except Exception:  # noqa: BLE001 - one bad root must not hide the others
            log.warning("dashboard: cannot list run root %s", root, exc_info=True)
            continue
        out.extend(summarize(i, root, run_id, active_window_s) for run_id in ids)
    out.sort(key=lambda r: (-(r.updated or 0.0), r.run_id))
    return out
