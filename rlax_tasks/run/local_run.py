"""`rlax run`: every component as a local process under a supervisor, then a report; with a
compute backend (`--backend ray`), every job on the backend's slices instead.

The launch steps are the DAG's (rlax_tasks.plan.launch), under the run lock, and what starts
is the same TrainingPlan the rlax_train DAG launches (docs/design.md §10); the supervisor
restarts a component that dies (all resume from the run's files), prints status and notices,
and a fatal notice or repeated failure stops the run with that component's own message."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from rlax_tasks.config import RunConfig
from rlax_tasks.plan import launch
from rlax_tasks.plan.run_plan import TrainingPlan
from rlax_tasks.plan.topology import free_ports
from rlax_tasks.run.heldout import HeldOutJobs
from rlax_tasks.run.progress import HeldOutProgress, status_line, trained_step
from rlax_tasks.run.report import write_report
from rlax_tasks.run.slice_supervisor import SliceSupervisor, run_slices
from rlax_tasks.run.supervisor import Component, ComponentFailed, Supervisor, stop_on_signals
from rlax_tasks.rundir import lock as run_lock
from rlax_tasks.rundir import notices
from rlax_tasks.rundir.paths import run_paths
from rlax_tasks.services.http import run_token

log = logging.getLogger(__name__)


def run_local(
    cfg: RunConfig,
    steps: int,
    *,
    evaluate: bool = True,
    status_every_s: float = 10.0,
    supervisor_hook: Any = None,
    allow_config_change: bool = False,
    backend: Any = None,
) -> dict[str, Any]:
    """Runs ``steps`` training steps (in total, across resumes) of ``cfg`` on this machine, or
    on ``backend``'s slices (a ``rlax_tasks.compute`` backend: ``ray``).

    A run already at ``steps`` starts nothing and returns ``{"already_at": step, ...}``. Raises
    ValueError (a user mistake: a bad plan or dataset, a refused settings change), RunLocked,
    ComponentFailed, or Interrupted (SIGTERM/SIGINT/SIGHUP); every component is stopped first."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: give a positive number of training steps, got {steps!r}")
    if "://" in cfg.run_root:
        raise ValueError(
            "run_root: rlax run needs a local run root (with --backend ray: a path every node "
            "mounts); run a gs:// run root with the rlax_train DAG"
        )
    if cfg.placement.hosts > 1 and backend is None:
        raise ValueError(
            f"placement.hosts: rlax run starts every job on this machine, the placement spans "
            f"{cfg.placement.hosts} hosts (run it on a Ray cluster with --backend ray, or with "
            "the rlax_train DAG on a multi-host backend)"
        )
    slices = run_slices(cfg) if backend is not None else None
    plan = launch.check_run(cfg)  # refused before anything starts, naming what to change
    run_dir = cfg.run_dir
    os.makedirs(run_dir, exist_ok=True)
    with run_lock.acquire(run_dir) as lock, stop_on_signals() as signals:
        done = trained_step(run_dir)
        if done >= steps:
            return {"run_dir": run_dir, "steps": steps, "already_at": done}
        config_path = launch.prepare_run_dir(cfg, allow_config_change)
        report: dict[str, Any] = {"run_dir": run_dir, "steps": steps}
        logs = run_paths(run_dir).logs
        if slices is None:
            sup: Any = Supervisor(logs)
        else:
            sup = SliceSupervisor(backend, cfg.run_id, logs, slices.types, run_root=cfg.run_root)
        sup.progress = lambda: trained_step(run_dir)  # a failure repeated without a step trained
        # held-out pass@k runs as a job of its own (this process never loads a model): the
        # starting weights first, alone on the devices, then beside training where it can
        heldout = HeldOutJobs(cfg, config_path, steps) if evaluate else None
        every = heldout.every if heldout is not None else 0
        progress: HeldOutProgress | None = None
        try:
            if slices is not None:
                sup.provision()  # (a resume finds the run's slices if they are still there)
            if heldout is not None:
                heldout.start(sup, base=True, every=every, last=steps if every else None,
                              after=done)  # fmt: skip
                report["before"] = heldout.wait(sup, 0)
                if not every:  # it evaluated the starting weights only: gone (its process and
                    heldout.stop(sup)  # its GPU memory) before the training jobs start
            token = run_token()
            # every job's environment names this lock's holder: the controller finds the lock
            # held for it (run_lock.for_job)
            run_plan = launch.plan_jobs(
                cfg, steps, config_path, plan, token,
                None if slices is not None else free_ports(cfg),  # slices: published addresses
                run_lock.holder_env(lock),
                worker_slices=None if slices is None else slices.workers,
            )  # fmt: skip
            t0 = time.monotonic()
            if every:
                progress = HeldOutProgress(run_dir, time.time())
                progress.record(0, report["before"])
            _, seen = notices.read_since(run_dir)  # a resume prints only the notices of this run
            training = _add_jobs(sup, run_plan, on_slices=slices is not None)
            ending = run_plan.controller.name  # its exit 0 ends the run (colocated: its one job)
            last = 0.0
            while True:
                lock.check()
                seen = _print_notices(run_dir, seen)
                try:
                    finished = sup.poll()
                except ComponentFailed:
                    _print_notices(run_dir, seen)  # its fatal notice says more than its log
                    raise
                if ending in finished:
                    break
                if supervisor_hook is not None:
                    supervisor_hook(sup)
                if progress is not None:
                    for row in heldout.results():
                        progress.record_result(row)
                if time.monotonic() - last >= status_every_s:
                    last = time.monotonic()
                    log.info("%s", status_line(run_dir, steps, t0))
                time.sleep(0.2)
            _print_notices(run_dir, seen)
            report["train_seconds"] = time.monotonic() - t0
            report["restarts"] = {n: sup.components[n].restarts for n in training}
            if heldout is not None:
                sup.stop(training)  # the parameter server flushes its mirror as it stops
                record = None if progress is None else progress.record_result
                # a job evaluating during training goes on to the last version itself
                report["after"] = heldout.finish(sup, every > 0, record)
        finally:
            signals.stopping()  # a second Ctrl-C must not cut the stopping short
            sup.stop()
        if heldout is not None:
            report.update(write_report(cfg, report))
    return report


def _add_jobs(sup: Any, run_plan: TrainingPlan, on_slices: bool) -> list[str]:
    """Starts every job of ``run_plan`` under ``sup``; returns the names of its components.
    Exit 0 of the controller = done (a crash is still restarted). Local processes: a multi-host
    job is one process per host, restarted together; on slices, one job over its hosts."""
    if on_slices:
        for job in run_plan.jobs():
            component = Component(job.name, job.argv, job.env, restart=job.service)
            sup.add(component, job.slice, job.hosts)
        return [job.name for job in run_plan.jobs()]
    for name, job, env in run_plan.processes():
        group = job.name if len(job.hosts) > 1 else None
        sup.add(Component(name, job.argv, env, restart=job.service, group=group))
    return [name for name, _, _ in run_plan.processes()]


def _print_notices(run_dir: str, offset: int) -> int:
    """Prints the notices posted since ``offset`` (once each); a fatal one stops the run."""
    new, offset = notices.read_since(run_dir, offset)
    for notice in new:
        print(notice.format(), flush=True)
    for notice in new:
        if notice.kind == "fatal":
            path = os.path.join(run_paths(run_dir).logs, f"{notice.source}.log")
            raise ComponentFailed(notice.source, f"{notice.source}: {notice.message} (log: {path})")
    return offset
