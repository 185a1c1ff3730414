"""Held-out pass@k as a job of its own (`rlax heldout`), so that `rlax run`'s supervisor, which
only reads its results, never loads JAX's accelerator backend (docs/design.md §10).

The job evaluates the starting weights (``--base``), then every ``--every``-th version as the
run mirrors it under run_dir/weights, and ends after the run's last version (``--last``); each
result is a row of run_dir/eval/heldout_scores.jsonl. One compiled sampler serves every
version, so evaluating during a run costs generation only."""

from __future__ import annotations

import io
import json
import logging
import time
from typing import Any

from rlax_tasks.config import RunConfig
from rlax_tasks.paramserver import mirror
from rlax_tasks.plan.placement import HELDOUT, job_env, trainer_job
from rlax_tasks.run.supervisor import Component, ComponentFailed, Supervisor
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

log = logging.getLogger(__name__)

JOB = HELDOUT  # its name among the run's jobs (logs/heldout.log)
POLL_S = 0.5  # how often the job looks for a newly mirrored version
WAIT_POLL_S = 0.2  # how often `rlax run` looks for the job's results while it waits for one


def next_target(version: int, every: int) -> int:
    """The first multiple of ``every`` after ``version``: the next version worth evaluating."""
    return (version // every + 1) * every


def heldout_argv(config_path: str, *, base: bool, every: int, last: int | None,
                 after: int = 0) -> list[str]:  # fmt: skip
    """`rlax heldout` of the run config at ``config_path``: the starting weights when ``base``,
    every ``every``-th version after ``after`` (0: none), and version ``last`` (None: none)."""
    argv = [JOB, "--config", config_path, "--every", str(every), "--after", str(after)]
    if base:
        argv.append("--base")
    if last is not None:
        argv += ["--last", str(last)]
    return argv


def read_scores(run_dir: str, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """(the rows appended to eval/heldout_scores.jsonl since byte ``offset``: results and
    ``is_result``'s marks, the new offset); a line not yet complete is left for the next read."""
    path = run_paths(run_dir).heldout_scores
    new = io.BytesIO()
    try:
        info = storage.stat(path)  # on GCS: a metadata request, the rows only when it grew
        if info is None:
            return [], offset
        storage.download_range(path, new, offset, info.size)
    except FileNotFoundError:
        return [], offset
    data = new.getvalue()
    end = data.rfind(b"\n") + 1
    rows = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return rows, offset + end


def is_result(row: dict[str, Any]) -> bool:
    """Whether a row of eval/heldout_scores.jsonl is a result (else the marker of an evaluation
    that started: {"evaluating": version, "time"})."""
    return "evaluating" not in row


def scores_offset(run_dir: str) -> int:
    """Where rows of a job started now will begin in eval/heldout_scores.jsonl."""
    info = storage.stat(run_paths(run_dir).heldout_scores)
    return 0 if info is None else info.size


def append_row(run_dir: str, row: dict[str, Any]) -> None:
    """Adds ``row`` to eval/heldout_scores.jsonl, local or gs:// (an object cannot be appended
    to: rewritten whole, a few rows an evaluation; the job is its one writer)."""
    line = json.dumps(row, default=float) + "\n"
    storage.append_line(run_paths(run_dir).heldout_scores, line.encode())


def run_heldout(cfg: RunConfig, *, base: bool, every: int, last: int | None, after: int = 0,
                poll_s: float = POLL_S) -> int:  # fmt: skip
    """The job's loop (see the module docstring); returns how many versions it evaluated."""
    # lazy: the model and the sampler load only in this job
    from rlax_tasks.run.report import HeldOutEvaluator, MirroredWeights

    evaluator = HeldOutEvaluator(cfg)
    weights = MirroredWeights(cfg.run_dir, evaluator.policy)
    done = 0
    if base:
        append_row(cfg.run_dir, {"evaluating": 0, "time": time.time()})
        append_row(cfg.run_dir, evaluator.evaluate())
        done += 1
    target = next_target(after, every) if every else None
    while last is not None or target is not None:
        newest = mirror.newest_committed(cfg.run_dir)
        due = [v for v in (last, target) if v is not None]
        if newest is None or newest < min(due):
            time.sleep(poll_s)
            continue
        append_row(cfg.run_dir, {"evaluating": newest, "time": time.time()})
        try:
            result = evaluator.evaluate(weights, version=newest)
        except FileNotFoundError as e:  # collected by the mirror's GC meanwhile: the next one
            log.warning("held-out evaluation of version %d skipped: %s", newest, e)
            continue
        append_row(cfg.run_dir, result)
        done += 1
        if last is not None and result["version"] >= last:
            break  # the run's last version: the job ends
        if target is not None:
            target = next_target(result["version"], every)
    return done


def every_during_training(cfg: RunConfig) -> tuple[int, str | None]:
    """(how often the held-out job evaluates beside training: eval.every_steps where it has
    devices of its own, placement.evaluator, or cpu devices; else 0, and why in a line). On the
    trainer's gpu or tpu devices it evaluates before and after training only."""
    every = cfg.eval.every_steps
    if not every or cfg.placement.platform == "cpu" or cfg.placement.evaluator is not None:
        return every, None
    return 0, (
        f"eval.every_steps: on {cfg.placement.platform} the held-out job would share the "
        "trainer's devices; this run is evaluated before and after training (give the job "
        "devices of its own with placement.evaluator, or evaluate versions meanwhile with `rlax "
        "eval --weights-from RUN_DIR@VERSION` or the rlax_nightly_eval DAG)"
    )


def heldout_env(cfg: RunConfig) -> dict[str, str]:
    """The held-out job's devices: its own (placement.evaluator), else the trainer's."""
    return job_env(cfg, JOB if cfg.placement.evaluator is not None else trainer_job(cfg))


class HeldOutJobs:
    """`rlax run`'s side of the held-out job: started under its supervisor on its own devices
    (placement.evaluator), else on the trainer's (a colocated run: its one job's), its results
    read from the run's files."""

    def __init__(self, cfg: RunConfig, config_path: str, steps: int) -> None:
        self.cfg, self.config_path, self.steps = cfg, config_path, steps
        self.env = heldout_env(cfg)
        self.offset = scores_offset(cfg.run_dir)
        self.newest: dict[str, Any] | None = None  # the newest result read in this launch
        self.every, why_not = every_during_training(cfg)
        if why_not:
            log.warning("%s", why_not)

    def start(self, sup: Supervisor, *, base: bool, every: int, last: int | None,
              after: int = 0) -> None:  # fmt: skip
        """Starts (or starts again) the job under ``sup``: see ``heldout_argv``."""
        argv = heldout_argv(self.config_path, base=base, every=every, last=last, after=after)
        sup.add(Component(JOB, argv, self.env, restart=False))  # restarted only on a failure

    def stop(self, sup: Supervisor) -> None:
        """Stops the job and waits until it has exited, so that its devices are free."""
        sup.stop([JOB])

    def results(self) -> list[dict[str, Any]]:
        """The results written since the last call (none before this launch)."""
        rows, self.offset = read_scores(self.cfg.run_dir, self.offset)
        results = [r for r in rows if is_result(r)]
        for row in results:
            if self.newest is None or row["version"] >= self.newest["version"]:
                self.newest = row
        return results

    def wait(self, sup: Supervisor, version: int,
             on_result: Any = None) -> dict[str, Any]:  # fmt: skip
        """Polls ``sup`` (a crashed job restarts) until the job has evaluated ``version`` or a
        newer one; returns that result (``on_result`` is called with each result read)."""
        if self.newest is not None and self.newest["version"] >= version:
            return self.newest
        while True:
            ended = JOB in sup.poll()
            for row in self.results():  # read after the poll: an ended job's rows are all in
                if on_result is not None:
                    on_result(row)
                if row["version"] >= version:
                    return row
            if ended:
                raise ComponentFailed(
                    JOB, f"{JOB} ended without evaluating version {version} "
                    f"(log: {sup.log_path(JOB)})",
                )  # fmt: skip
            time.sleep(WAIT_POLL_S)

    def finish(self, sup: Supervisor, running: bool, on_result: Any = None) -> dict[str, Any]:
        """After training (its jobs stopped): the result of the run's newest mirrored version,
        from the running job when it will evaluate it, else from a job started for it."""
        newest = mirror.newest_committed(self.cfg.run_dir)
        if newest is None:
            raise FileNotFoundError(f"{self.cfg.run_dir}/weights: no version mirrored to evaluate")
        if running and newest < self.steps:  # it waits for a version that will not come
            self.stop(sup)
            running = False
        if not running:
            self.start(sup, base=False, every=0, last=newest)
        result = self.wait(sup, newest, on_result)
        self.stop(sup)
        return result
