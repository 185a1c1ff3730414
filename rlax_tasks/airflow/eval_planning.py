"""The DAGs' held-out evaluations: `rlax eval` command lines, the base-evaluation cache, the
nightly scan and history, and the run report (eval/report.md) of a trained run.

The DAG files import this module when the scheduler parses them: the run config, the evaluation
package and the rest load inside the functions, which run in tasks."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import re
import time
from typing import Any

from rlax_tasks.airflow.params import RUN_ID_PATTERN
from rlax_tasks.airflow.run_status import read_status
from rlax_tasks.plan.slices import PlanError
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

log = logging.getLogger(__name__)


def eval_dataset_file(cfg: Any) -> str:
    """A held-out dataset file for ``rlax eval``: the config's eval file, or its synthetic task
    written once to run_dir/eval/heldout.jsonl in the curated schema."""
    # lazy: loads in the task, not when the scheduler parses the DAGs
    from rlax_tasks.config import FileSource, SyntheticSource

    spec = cfg.eval.dataset
    if spec is None:
        raise PlanError("eval.dataset: the run config names no held-out dataset")
    if isinstance(spec.source, FileSource):
        return spec.source.path
    assert isinstance(spec.source, SyntheticSource)
    path = run_paths(cfg.run_dir).heldout
    if storage.exists(path):
        return path
    src = spec.source
    if src.prompt_format == "compact":
        # lazy: loads in the task, not when the scheduler parses the DAGs
        from rlax_tasks.warmup import TinyArith

        fmt = TinyArith(dict(src.knobs))
        problems = fmt.problems(cfg.eval.num_prompts, seed=src.seed)
        rows = [(p.prompt, fmt.answer_text(p)) for p in problems]
    else:
        # lazy: loads in the task, not when the scheduler parses the DAGs
        from rlax_tasks.rewards.tasks import make_task

        problems = make_task(src.task, **dict(src.knobs)).generate(cfg.eval.num_prompts, src.seed)
        rows = [(p.prompt, p.reference) for p in problems]
    today = dt.date.today().isoformat()
    lines = [
        json.dumps({"prompt": q, "answer": a, "source": spec.name, "date": today}) for q, a in rows
    ]  # the row schema (format rlax)
    storage.write_bytes(path, ("\n".join(lines) + "\n").encode())
    return path


def eval_argv(cfg: Any, version: int, dataset: str) -> list[str]:
    """`rlax eval` of weight ``version`` mirrored under the run, into run_dir/eval/v<version>/
    (the directory the dashboard reads pass@k from): the dataset read in its format, prompts
    rendered by the run's own `prompt` section (its config.yaml), as in training."""
    return _eval_argv(cfg, dataset, ["--weights-from", f"{cfg.run_dir}@{version}"], version)


def base_eval_argv(cfg: Any, dataset: str) -> list[str]:
    """`rlax eval` of the run's starting weights (the model directory alone) into
    run_dir/eval/v0/: the same evaluation as ``eval_argv``'s of the final weights."""
    # lazy: loads in the task, not when the scheduler parses the DAGs
    from rlax_tasks.evaluation.base_eval import BASE_VERSION

    return _eval_argv(cfg, dataset, [], BASE_VERSION)


def _eval_argv(cfg: Any, dataset: str, weights: list[str], version: int) -> list[str]:
    # lazy: loads in the task, not when the scheduler parses the DAGs
    from rlax_tasks.config import FileSource

    paths = run_paths(cfg.run_dir)
    e = cfg.eval
    source = e.dataset.source if e.dataset is not None else None
    data_format: list[str] = []
    if e.dataset is not None and e.dataset.environment is not None:  # multi-turn, as in training
        data_format = ["--environment-from", paths.config]
    if isinstance(source, FileSource):
        data_format = ["--format", source.format]
        if source.columns:
            data_format += ["--columns", ",".join(f"{k}={v}" for k, v in source.columns.items())]
    return [
        "eval", "--model-dir", cfg.model.path, *weights,
        "--dataset", dataset, "--n", str(e.num_samples), "--k", ",".join(map(str, e.ks)),
        "--limit", str(e.num_prompts), "--temperature", str(e.temperature),
        "--max-new-tokens", str(cfg.rollout.max_new_tokens),
        "--max-len", str(cfg.workers.max_len), "--max-slots", str(cfg.workers.slots),
        "--dtype", cfg.model.dtype, "--out", paths.eval_dir(version),
        "--prompt-config", paths.config, *data_format,
    ]  # fmt: skip


def prepare_base_eval(run_dir: str) -> dict[str, Any]:
    """The base evaluation of the run at ``run_dir`` (``rlax_tasks.evaluation.base_eval``): when
    the run root caches it, copies it into run_dir/eval/v0 and gives an empty ``argv`` (the
    evaluate_base job is skipped); else ``argv`` is the `rlax eval` to run. The plan as a dict
    (for ``record_base_eval``)."""
    # lazy: loads in the task, not when the scheduler parses the DAGs
    from rlax_tasks.evaluation import base_eval

    cfg = load_run_config(run_dir)
    plan = base_eval.plan_base_eval(cfg, base_eval_argv(cfg, eval_dataset_file(cfg)))
    if base_eval.restore(plan):
        return {**plan.to_dict(), "argv": []}
    log.info("base evaluation %s not cached: evaluating (rlax %s)", plan.fingerprint,
             " ".join(plan.argv))  # fmt: skip
    return plan.to_dict()


def record_base_eval(plan: dict[str, Any]) -> None:
    """After the evaluate_base job: caches the run's fresh eval/v0 under its fingerprint (a
    plan restored from the cache has nothing to record)."""
    # lazy: loads in the task, not when the scheduler parses the DAGs
    from rlax_tasks.evaluation import base_eval

    if plan["argv"]:
        base_eval.store(base_eval.BaseEvalPlan.from_dict(plan))


def record_nightly_history(runs: list[dict[str, Any]], dag_run_id: str) -> list[dict[str, Any]]:
    """Appends each evaluated run's new evaluation ({"run_dir", "version"}) to its history
    (run_dir/eval/history.jsonl); a run whose evaluation failed is logged and left out."""
    # lazy: loads in the task, not when the scheduler parses the DAGs
    from rlax_tasks.evaluation.history import append_evaluation

    rows = []
    for item in runs:
        row = append_evaluation(item["run_dir"], int(item["version"]), dag_run_id)
        if row is not None:
            rows.append({"run_dir": item["run_dir"], **row})
    return rows


def newest_version(run_dir: str) -> int | None:
    """The newest committed weight version mirrored under run_dir/weights (None: none yet)."""
    # lazy: loads in the task, not when the scheduler parses the DAGs
    from rlax_tasks.paramserver import mirror

    return mirror.newest_committed(run_dir)


def write_run_report(run_dir: str) -> str:
    """eval/report.md, report.json and the plots of a trained run, as `rlax run` writes them:
    the held-out scores of the starting weights (eval/v0) against the newest evaluated version;
    the training time spans the metrics rows (first to last step). Returns report.md's path."""
    # lazy: loads in the task, not when the scheduler parses the DAGs
    from rlax_tasks.evaluation.history import evaluated_versions, read_overall
    from rlax_tasks.run.report import write_report

    paths = run_paths(run_dir)
    versions = evaluated_versions(run_dir)
    if not versions or versions[0] != 0 or versions[-1] == 0:
        raise FileNotFoundError(
            f"{paths.eval}: the report needs the evaluations of the starting weights (v0) and "
            f"of a trained version; found {[f'v{v}' for v in versions] or 'none'}"
        )
    before, after = read_overall(run_dir, 0), read_overall(run_dir, versions[-1])
    metrics = [m for m in storage.read_jsonl(paths.metrics) if "time" in m and "step" in m]
    report = {
        "before": {"version": 0, **before},
        "after": {"version": versions[-1], **after},
        "steps": metrics[-1]["step"] if metrics else versions[-1],
        "train_seconds": metrics[-1]["time"] - metrics[0]["time"] if metrics else 0.0,
    }
    _progress_from_heldout_job(run_dir, report, metrics[0]["time"] if metrics else 0.0)
    return str(write_report(load_run_config(run_dir), report)["report"])


def _progress_from_heldout_job(run_dir: str, report: dict[str, Any], t0: float) -> None:
    """eval/progress.jsonl (the report's pass@k per step) rebuilt from the heldout task's
    results during training, between the evaluations before and after; nothing without any.
    ``seconds`` counts from ``t0``, the run's first step."""
    from rlax_tasks.run.heldout import is_result, read_scores
    from rlax_tasks.run.progress import HeldOutProgress

    rows, _ = read_scores(run_dir)
    during = [r for r in rows if is_result(r) and 0 < r["version"] < report["after"]["version"]]
    if not during:
        return
    storage.delete_prefix(run_paths(run_dir).eval_progress)  # a retried report writes it anew
    progress = HeldOutProgress(run_dir, t0)
    for result in [report["before"], *sorted(during, key=lambda r: r["version"])]:
        progress.record_result(result)
    progress.record_result(report["after"])


def load_run_config(run_dir: str) -> Any:
    """The resolved run configuration saved at run_dir/config.yaml."""
    # lazy: loads in the task, not when the scheduler parses the DAGs
    from rlax_tasks.config import load_config

    path = run_paths(run_dir).config
    if not storage.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    return load_config(path)


def runs_to_evaluate(roots: list[str], active_within_s: float) -> list[dict[str, Any]]:
    """Runs under ``roots`` with a committed weight version not evaluated yet and activity
    (metrics or status) within ``active_within_s``: [{"run_dir", "version"}]."""
    out = []
    now = time.time()
    for root in roots:
        for name in storage.list_children(root):
            run_dir = storage.join(root, name)
            paths = run_paths(run_dir)
            if not re.match(RUN_ID_PATTERN, name) or not storage.exists(paths.config):
                continue
            status = read_status(run_dir) or {}
            updated = float(status.get("updated") or 0.0)
            metrics = paths.metrics
            if not storage.is_gcs(metrics) and os.path.exists(metrics):
                updated = max(updated, os.stat(metrics).st_mtime)
            if now - updated > active_within_s:
                continue
            version = newest_version(run_dir)
            done = paths.eval_results(version)
            if version is not None and not storage.exists(done):
                out.append({"run_dir": run_dir, "version": version})
    return out
