"""The file names of one run directory (docs/design.md §7): the one module that spells them.

``run_paths(run_dir)`` gives every fixed file and folder of ``run_root/<run_id>/`` (a local
path or a ``gs://`` URI), e.g. ``paths.status``, ``paths.eval_results(3)``; everything else
imports it. JAX-free, so the Airflow plugin, the DAGs and the trainer all use it."""

from __future__ import annotations

import dataclasses

from rlax_tasks.rundir import storage

# the names, relative to the run directory (docs/design.md §7 is the contract: do not rename)
CONFIG = "config.yaml"  # the resolved run configuration
CHECKPOINTS = "checkpoints"  # Orbax checkpoints, checkpoints/<step>/
WEIGHTS = "weights"  # the parameter server's durable mirror, weights/v<version>/
SNAPSHOTS = "snapshots"  # controller snapshots, snapshots/<step>.json
SNAPSHOT_POINTER = "LATEST"  # snapshots/LATEST: the newest committed snapshot
ROLLOUTS = "rollouts"  # scored rollouts as Parquet
LINEAGE = "lineage.jsonl"  # per step: prompts consumed, rollout versions used, dropped
METRICS = "metrics.jsonl"  # per step metrics
WEIGHT_SYNC = "weight_sync.jsonl"  # per pushed version: the push time
TB = "tb"  # TensorBoard events
EVAL = "eval"  # evaluation results and plots
EVAL_RESULTS = "results.json"  # eval/v<version>/results.json: one evaluation's results
EVAL_PROGRESS = "progress.jsonl"  # eval/progress.jsonl: the in-training evaluations
EVAL_HISTORY = "history.jsonl"  # eval/history.jsonl: one row per nightly evaluation
HELDOUT = "heldout.jsonl"  # eval/heldout.jsonl: the held-out prompts
HELDOUT_SCORES = "heldout_scores.jsonl"  # eval/heldout_scores.jsonl: `rlax heldout`'s results
REPORT_JSON = "report.json"  # eval/report.json: the run report's numbers
REPORT_MD = "report.md"  # eval/report.md: the run report
STATUS = "status.json"  # the Airflow run's status record
WORKERS = "workers.json"  # the rollout workers' addresses
SERVICES = "services"  # services/<job>.json: the address each service published
LOGS = "logs"  # the local run's process logs
DONE = "DONE"  # marker: the run is complete
SLICES = "slices"  # the compute backends' per-slice state, slices/<name>/
NOTICES = "notices.jsonl"  # what a person watching the run must read (fallbacks, fatal errors)
LOCK = "run.lock"  # held while a run is alive: a local file lock, or a lease object on gs://
CONFIG_CHANGES = "config_changes.jsonl"  # settings changed on an allowed resume, with the step
AIRFLOW_LOG = "airflow.log"  # logs/airflow.log: Airflow's own logs of `rlax airflow train`
# beside the runs, in the run root: <run_root>/base-evals/<fingerprint>/, the cached evaluations
# of base models (rlax_tasks.evaluation.base_eval), shared by every run of that root
BASE_EVALS = "base-evals"


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """The paths of one run directory's fixed files and folders (see the module constants)."""

    root: str
    config: str
    checkpoints: str
    weights: str
    snapshots: str
    snapshot_pointer: str
    rollouts: str
    lineage: str
    metrics: str
    weight_sync: str
    tb: str
    eval: str
    eval_progress: str
    eval_history: str
    heldout: str
    heldout_scores: str
    report_json: str
    report_md: str
    status: str
    workers: str
    services: str
    logs: str
    done: str
    slices: str
    notices: str
    lock: str
    config_changes: str
    airflow_log: str

    def service(self, job: str) -> str:
        """``services/<job>.json``: where job ``job`` publishes its address."""
        return storage.join(self.services, f"{job}.json")

    def eval_dir(self, version: int) -> str:
        """``eval/v<version>``: the evaluation of weight version ``version``."""
        return storage.join(self.eval, f"v{version}")

    def eval_results(self, version: int) -> str:
        """``eval/v<version>/results.json``."""
        return storage.join(self.eval_dir(version), EVAL_RESULTS)


# attribute of RunPaths -> its path below the run directory
_LAYOUT: dict[str, tuple[str, ...]] = {
    "config": (CONFIG,), "checkpoints": (CHECKPOINTS,), "weights": (WEIGHTS,),
    "snapshots": (SNAPSHOTS,), "snapshot_pointer": (SNAPSHOTS, SNAPSHOT_POINTER),
    "rollouts": (ROLLOUTS,), "lineage": (LINEAGE,), "metrics": (METRICS,),
    "weight_sync": (WEIGHT_SYNC,), "tb": (TB,), "eval": (EVAL,),
    "eval_progress": (EVAL, EVAL_PROGRESS), "eval_history": (EVAL, EVAL_HISTORY),
    "heldout": (EVAL, HELDOUT), "heldout_scores": (EVAL, HELDOUT_SCORES),
    "report_json": (EVAL, REPORT_JSON), "report_md": (EVAL, REPORT_MD), "status": (STATUS,),
    "workers": (WORKERS,), "services": (SERVICES,), "logs": (LOGS,), "done": (DONE,),
    "slices": (SLICES,), "notices": (NOTICES,),
    "lock": (LOCK,), "config_changes": (CONFIG_CHANGES,), "airflow_log": (LOGS, AIRFLOW_LOG),
}  # fmt: skip


def run_paths(run_dir: str) -> RunPaths:
    """The fixed paths of the run directory ``run_dir`` (local path or gs:// URI)."""
    return RunPaths(run_dir, **{k: storage.join(run_dir, *p) for k, p in _LAYOUT.items()})


def base_eval_dir(run_root: str, fingerprint: str) -> str:
    """``<run_root>/base-evals/<fingerprint>``: a base model's cached evaluation (a run-root
    folder, not a run's: every run of the root with the same model, data and settings reuses it)."""
    return storage.join(run_root, BASE_EVALS, fingerprint)
