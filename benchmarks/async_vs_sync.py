"""Asynchronous vs on-policy lockstep RL on a preset (`rlax run`; tiny-arith, or ``--preset
tiny-calc`` for multi-turn calculator episodes), in one run:
lockstep (reload_every = max_staleness = 1) vs async (``--async-j 2 --async-k 4``), same seed and
steps, each in a fresh run root. Reports seconds per step, held-out pass@1/pass@8 before and
after, and the wall time to a held-out pass@1 target (base + ``--gain``). Runs take turns, never
overlap. ``.venv/bin/python benchmarks/async_vs_sync.py [--steps 150] [--json-out FILE]``

``--compare interrupt``: two async runs instead, workers continuing their sequences on new
weights (``workers.interrupt_on_reload``) against finishing them on the old version, with the
trainer's jobs and the workers pinned to separate cores (``--pin``, as taskset would); adds the
rollout tokens trained on per second. Both modes report the model tokens trained on (an
episode's observations are masked out) and the share of episodes whose tokens span more than one
weight version (a weight update landed mid-episode)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _setup  # noqa: E402, F401  (the repository root on sys.path; JAX on the CPU by default)

from benchmarks._timing import (  # noqa: E402
    contended_mark,
    describe_load,
    machine_load,
    peak_rss_bytes,
    setup_logging,
)
from rlax_tasks.run.heldout import JOB, is_result, read_scores, scores_offset  # noqa: E402
from rlax_tasks.rundir.storage import read_jsonl  # noqa: E402

log = logging.getLogger("benchmarks.async_vs_sync")

PRESET = "tiny-arith"


def base_model_dir(preset: str = PRESET) -> str:
    """The preset's base model (built by the supervised warm-up when missing), absolute."""
    from rlax_tasks.config import load_config
    from rlax_tasks.plan.launch import ensure_model

    cfg = load_config(preset)
    ensure_model(cfg)  # as `rlax run` does: the recipe named by the model directory
    return os.path.abspath(cfg.model.path)


def step_times(metrics: list[dict[str, Any]]) -> dict[int, float]:
    """Unix time each training step was applied (metrics.jsonl "time"), by step."""
    return {int(m["step"]): float(m["time"]) for m in metrics if "time" in m and "step" in m}


def step_intervals(metrics: list[dict[str, Any]]) -> list[float]:
    """Seconds between consecutive training steps."""
    by_step = step_times(metrics)
    times = [by_step[s] for s in sorted(by_step)]
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def run_start_unix(metrics: list[dict[str, Any]], progress: list[dict[str, Any]]) -> float | None:
    """The unix time the run's clock started: progress.jsonl "seconds" of a version is the
    metrics.jsonl "time" of that step minus the start."""
    times = step_times(metrics)
    starts = [
        times[int(r["version"])] - float(r["seconds"])
        for r in progress
        if r.get("seconds") is not None and int(r.get("version", 0)) in times
    ]
    return statistics.median(starts) if starts else None


def curve(progress: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """progress.jsonl rows, one per version (the last row of a version wins), by version."""
    rows = {int(r["version"]): r for r in progress if "pass@1" in r}
    return [rows[v] for v in sorted(rows)]


def time_to_target(progress: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first trained version (> 0) whose held-out pass@1 reaches ``target``, else None."""
    for r in curve(progress):
        if r["version"] > 0 and r["pass@1"] >= target and r.get("seconds") is not None:
            return {"seconds": r["seconds"], "step": r["version"], "pass@1": r["pass@1"]}
    return None


class StopRun(Exception):
    """Raised from the supervisor hook to end a run early (its processes are stopped)."""


class EvalPauses:
    """Holds a run's training processes still (SIGSTOP) while its held-out job evaluates a
    version during the run, from the job's "evaluating" mark until its result is written, and
    takes those pauses (unix start, end) off the run's clock, as TRL's clock pauses for its
    evaluation; otherwise the held-out job would compete with training for the cores, which
    only ours pays for. ``follow`` is called from the supervisor hook (every 0.2 s); an
    evaluation over before a hook saw it start is not a pause (ours paid for it)."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.offset = scores_offset(run_dir)
        self.pauses: list[tuple[float, float]] = []
        self._held: tuple[float, list[int]] | None = None  # (unix start, stopped groups)

    def follow(self, supervisor: Any) -> None:
        """Holds or releases the run after the held-out job's rows written since the last call."""
        rows, self.offset = read_scores(self.run_dir, self.offset)
        evaluating = None
        for row in rows:
            if not is_result(row):
                evaluating = int(row["evaluating"])
            else:
                evaluating = None
                self.release()
        if evaluating:  # a version of the run (not the starting weights), still evaluating
            procs = [c.proc for n, c in supervisor.components.items() if n != JOB]
            self.hold([p.pid for p in procs if p is not None and p.poll() is None])

    def hold(self, groups: list[int]) -> None:
        """Stops ``groups`` (each component leads its own), unless the run is held already."""
        if self._held is None and groups:
            t0 = time.time()
            for pgid in groups:
                _signal_group(pgid, signal.SIGSTOP)
            self._held = (t0, groups)

    def release(self) -> None:
        """Continues the processes ``hold`` stopped and records the pause."""
        if self._held is not None:
            t0, groups = self._held
            self._held = None
            for pgid in groups:
                _signal_group(pgid, signal.SIGCONT)
            self.pauses.append((t0, time.time()))

    def paused_before(self, t: float) -> float:
        """Seconds the run was held still before unix time ``t``."""
        return sum(max(0.0, min(b, t) - a) for a, b in self.pauses)

    def unpaused(self, metrics: list[dict[str, Any]], progress: list[dict[str, Any]]) -> None:
        """Takes the pauses off metrics.jsonl "time" and progress.jsonl "seconds" (in place)."""
        start = run_start_unix(metrics, progress)
        for r in progress:
            if r.get("seconds") is not None and start is not None:
                r["seconds"] = float(r["seconds"]) - self.paused_before(start + r["seconds"])
        for m in metrics:
            if "time" in m:
                m["time"] = float(m["time"]) - self.paused_before(float(m["time"]))


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


class CorePins:
    """Pins each job's processes and threads to its cores (``sched_setaffinity`` on every task
    of the job's process group, again at each supervisor poll to catch new threads): jobs whose
    name starts with "worker" on ``workers``, the others on ``rest``."""

    def __init__(self, workers: set[int], rest: set[int]) -> None:
        self.workers, self.rest = workers, rest

    def apply(self, supervisor: Any) -> None:
        groups = {
            c.proc.pid: self.workers if name.startswith("worker") else self.rest
            for name, c in supervisor.components.items()
            if c.proc is not None and c.proc.poll() is None
        }
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    pgrp = int(f.read().rsplit(")", 1)[1].split()[2])
                cores = groups.get(pgrp)
                if cores is not None:
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        os.sched_setaffinity(int(tid), cores)
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue


def parse_pin(text: str) -> tuple[set[int], set[int]]:
    """``--pin W:R`` (cores of the workers : cores of the other jobs, e.g. ``1:0`` or
    ``2-3:0-1``)."""

    def cores(part: str) -> set[int]:
        out: set[int] = set()
        for item in part.split(","):
            lo, _, hi = item.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
        return out

    workers, _, rest = text.partition(":")
    return cores(workers), cores(rest)


def rollout_figures(run_dir: str) -> dict[str, Any]:
    """The rollouts the run trained on: model tokens (observation tokens, masked out of the
    loss, not counted), sequences, and how many of them span more than one weight version."""
    from rlax_tasks.controller import read_rollouts

    rows = read_rollouts(run_dir)
    trained = spanning = 0
    for i in range(len(rows)):
        mask = rows["loss_mask"].iat[i] if "loss_mask" in rows else None
        versions = rows["token_versions"].iat[i] if "token_versions" in rows else None
        n = len(rows["tokens"].iat[i])
        keep = [True] * n if mask is None or len(mask) != n else [bool(m) for m in mask]
        trained += sum(keep)
        if versions is not None and len(versions) == n:
            spanning += len({int(v) for v, k in zip(versions, keep, strict=True) if k}) > 1
    return {"rollout_tokens": trained, "sequences": len(rows), "multi_version_sequences": spanning}


def run_ours(
    label: str,
    overrides: dict[str, Any],
    steps: int,
    *,
    model_dir: str,
    keep: bool = False,
    preset: str = PRESET,
    stop_when: Callable[[list[dict[str, Any]], float], str | None] | None = None,
    pause_for_eval: bool = False,
    pins: CorePins | None = None,
) -> dict[str, Any]:
    """One ``run_local`` of the preset in a fresh run root; returns what the benchmark reports.
    ``stop_when(progress_rows, seconds_since_start)`` may return a reason to end the run early
    (then no "after" eval); ``pause_for_eval``: hold the processes still during held-out
    evaluations and take those pauses off the clock (``EvalPauses``)."""
    from rlax_tasks.config import load_config
    from rlax_tasks.run.local_run import run_local

    root = tempfile.mkdtemp(prefix=f"rlax-bench-{label}-")
    cfg = load_config(
        preset, {"run_root": root, "run_id": label, "model.path": model_dir, **overrides}
    )
    progress_path = os.path.join(cfg.run_dir, "eval", "progress.jsonl")
    started: list[float] = []
    stopped = "steps"
    pauses = EvalPauses(cfg.run_dir)

    def hook(sup: Any) -> None:
        if pause_for_eval:
            pauses.follow(sup)
        if pins is not None:
            pins.apply(sup)
        if not started:
            started.append(time.monotonic())
        if stop_when is not None:
            why = stop_when(read_jsonl(progress_path), time.monotonic() - started[0])
            if why:
                pauses.release()  # stopped processes would not take the supervisor's SIGTERM
                raise StopRun(why)

    log.info("[%s] run_local: %d steps, overrides %s, run dir %s", label, steps, overrides, root)
    t0 = time.monotonic()
    try:
        report = run_local(cfg, steps, supervisor_hook=hook, status_every_s=20.0)
    except StopRun as e:
        stopped, report = str(e), {}
        log.info("[%s] stopped early: %s", label, stopped)
    wall = time.monotonic() - t0
    metrics = read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl"))
    progress = read_jsonl(progress_path)
    paused = pauses.paused_before(float("inf"))
    if paused:
        log.info("[%s] held still %.1f s in %d evaluations: taken off its clock", label,
                 paused, len(pauses.pauses))  # fmt: skip
        pauses.unpaused(metrics, progress)
        if report.get("train_seconds") is not None:
            report["train_seconds"] -= paused
    intervals = step_intervals(metrics)
    done = max((int(m["step"]) for m in metrics), default=0)
    start = run_start_unix(metrics, progress)
    times = list(step_times(metrics).values())
    train_s = report.get("train_seconds")
    if train_s is None and start is not None and times:  # stopped early: until its last step
        train_s = max(times) - start
    result = {
        "label": label,
        "overrides": overrides,
        "steps": done,
        "stopped": stopped,
        "wall_seconds": wall,
        "eval_pause_seconds": paused,
        "train_seconds": train_s,
        "seconds_per_step_total": (train_s / done) if train_s and done else None,
        "step_interval_median": statistics.median(intervals) if intervals else None,
        "step_interval_mean": statistics.fmean(intervals) if intervals else None,
        "step_interval_max": max(intervals) if intervals else None,
        # start-up of the processes, JAX compilation and the first batch
        "first_step_seconds": min(times) - start if times and start is not None else None,
        "before": _passes(report.get("before")) or _passes(curve(progress)[0] if progress else {}),
        "after": _passes(report.get("after")),
        "curve": [
            {k: r.get(k) for k in ("version", "seconds", "pass@1", "pass@8")}
            for r in curve(progress)
        ],
        "restarts": report.get("restarts"),
        **rollout_figures(cfg.run_dir),
        "reward_last10": (
            statistics.fmean(m["reward_mean"] for m in metrics[-10:] if "reward_mean" in m)
            if metrics
            else None
        ),
    }
    result["rollout_tokens_per_s"] = (
        result["rollout_tokens"] / train_s if train_s and result["rollout_tokens"] else None
    )
    if keep:
        result["run_dir"] = cfg.run_dir
    else:
        shutil.rmtree(root, ignore_errors=True)
    log.info(
        "[%s] %d steps in %.0fs wall; step interval median %s s; held-out pass@1 %s -> %s",
        label,
        done,
        wall,
        fmt_value(result["step_interval_median"]),
        fmt_value((result["before"] or {}).get("pass@1")),
        fmt_value((result["after"] or {}).get("pass@1")),
    )
    return result


def _passes(r: dict[str, Any] | None) -> dict[str, float] | None:
    if not r:
        return None
    return {k: float(v) for k, v in r.items() if k.startswith("pass@")} or None


def fmt_value(x: float | None, fmt: str = "{:.3f}") -> str:
    """``x`` formatted, or "-" when there is none."""
    return "-" if x is None else fmt.format(x)


def after_first_step(r: dict[str, Any]) -> dict[str, Any] | None:
    """Time to target counted from the run's first finished training step (no start-up)."""
    t, first = r.get("time_to_target"), r.get("first_step_seconds")
    if t is None or first is None:
        return None
    return {**t, "seconds": t["seconds"] - first}


def print_curves(results: dict[str, dict[str, Any]], heading: str) -> None:
    """Held-out pass@1 per evaluated version, one line per run: "version:pass@1@seconds"."""
    print(heading)
    width = max(len(label) for label in results)
    for label, r in results.items():
        pts = ", ".join(
            f"{c['version']}:{c['pass@1']:.3f}"
            + ("" if c["seconds"] is None else f"@{c['seconds']:.0f}s")
            for c in r["curve"]
        )
        print(f"  {label:{width}s} {pts}")


def print_table(
    columns: list[tuple[str, dict[str, Any]]], rows: list[tuple[str, Callable[[dict], str]]]
) -> None:
    """A plain side-by-side table: one column per mode, one line per figure."""
    cells = [[get(r) for _, r in columns] for _, get in rows]
    width = max(len(name) for name, _ in rows) + 2
    col = max(14, *(len(name) + 2 for name, _ in columns), *(len(c) + 2 for c in sum(cells, [])))
    print("".ljust(width) + "".join(name.rjust(col) for name, _ in columns))
    for (name, _), line in zip(rows, cells, strict=True):
        print(name.ljust(width) + "".join(c.rjust(col) for c in line))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", default=PRESET, help=f"run-config preset (default {PRESET})")
    ap.add_argument("--steps", type=int, default=150, help="training steps of each run")
    ap.add_argument("--eval-every", type=int, default=10, help="held-out pass@k every N steps")
    ap.add_argument("--gain", type=float, default=0.15, help="target = base pass@1 + gain")
    ap.add_argument("--target", type=float, default=None, help="absolute pass@1 target")
    ap.add_argument("--async-j", type=int, default=2, help="reload_every of the async run")
    ap.add_argument("--async-k", type=int, default=4, help="max_staleness of the async run")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument(
        "--compare",
        choices=("lockstep", "interrupt"),
        default="lockstep",
        help="async against lockstep, or async with interruptible workers against workers "
        "that finish their sequences on the old version",
    )
    ap.add_argument(
        "--pin",
        default=None,
        help="WORKER_CORES:OTHER_CORES, e.g. 1:0 (default for --compare interrupt on 2+ cores)",
    )
    ap.add_argument(
        "--max-new-tokens", type=int, default=None, help="rollout.max_new_tokens of every run"
    )
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    setup_logging()

    load_before = machine_load(log)
    busy = load_before["busy_cores"]
    model_dir = base_model_dir(args.preset)
    # the paper's layout: separate jobs, 2 workers (the tiny preset itself runs colocated)
    common = {
        "eval.every_steps": args.eval_every,
        "placement.mode": "disaggregated",
        "workers.count": 2,
        "workers.slots": 64,
    }
    if args.max_new_tokens is not None:
        common["rollout.max_new_tokens"] = args.max_new_tokens
    asynchronous = {"staleness.reload_every": args.async_j, "staleness.max_staleness": args.async_k}
    if args.compare == "interrupt":
        modes = [
            ("finish-on-old", {**asynchronous, "workers.interrupt_on_reload": False}),
            ("interruptible", {**asynchronous, "workers.interrupt_on_reload": True}),
        ]
        names = ["finish on old version", "interruptible"]
    else:
        modes = [
            ("lockstep", {"staleness.reload_every": 1, "staleness.max_staleness": 1}),
            ("async", asynchronous),
        ]
        names = ["lockstep j=k=1", f"async j={args.async_j},k={args.async_k}"]
    pin = args.pin or ("1:0" if args.compare == "interrupt" and (os.cpu_count() or 1) > 1 else None)
    pins = CorePins(*parse_pin(pin)) if pin else None
    if pins is not None:
        log.info("workers pinned to cores %s, the other jobs to %s", pins.workers, pins.rest)
    results = {}
    for label, overrides in modes:
        results[label] = run_ours(
            label,
            {**overrides, **common},
            args.steps,
            model_dir=model_dir,
            keep=args.keep,
            preset=args.preset,
            pins=pins,
        )
    load_after = machine_load(log, when="after")
    mark = contended_mark(load_before, load_after)
    sync, asyn = (results[label] for label, _ in modes)
    base = (sync["before"] or {}).get("pass@1")
    target = args.target if args.target is not None else (base or 0.0) + args.gain
    for r in results.values():
        r["target"] = target
        r["time_to_target"] = time_to_target(r["curve"], target)

    def spanning(r: dict[str, Any]) -> str:
        n = r["sequences"]
        return f"{r['multi_version_sequences']} of {n}" if n else "-"

    def ttt(r: dict[str, Any]) -> str:
        t = r["time_to_target"]
        return "not reached" if t is None else f"{t['seconds']:.1f}s (step {t['step']})"

    def ttt_after_first(r: dict[str, Any]) -> str:
        t = after_first_step(r)
        return "-" if t is None else f"{t['seconds']:.1f}s"

    print()
    print(
        f"{args.preset}, {args.steps} steps per run, eval every {args.eval_every} steps, "
        f"{os.cpu_count()} CPUs (before: {describe_load(load_before)}; after: "
        f"{describe_load(load_after)}){mark}; target held-out pass@1 {target:.3f}"
        + (
            f"; workers on cores {sorted(pins.workers)}, others on {sorted(pins.rest)}"
            if pins
            else ""
        )
        + (f" (base {base:.3f} + {args.gain})" if args.target is None and base is not None else "")
    )
    print_table(
        [(names[0], sync), (names[1], asyn)],
        [
            ("steps done", lambda r: str(r["steps"])),
            ("s/step (median interval)", lambda r: fmt_value(r["step_interval_median"])),
            ("s/step (mean interval)", lambda r: fmt_value(r["step_interval_mean"])),
            ("longest interval s", lambda r: fmt_value(r["step_interval_max"], "{:.1f}")),
            ("first step done at s", lambda r: fmt_value(r["first_step_seconds"], "{:.1f}")),
            ("train_seconds / steps", lambda r: fmt_value(r["seconds_per_step_total"])),
            ("train_seconds", lambda r: fmt_value(r["train_seconds"], "{:.1f}")),
            ("pass@1 before", lambda r: fmt_value((r["before"] or {}).get("pass@1"))),
            ("pass@1 after", lambda r: fmt_value((r["after"] or {}).get("pass@1"))),
            ("pass@8 before", lambda r: fmt_value((r["before"] or {}).get("pass@8"))),
            ("pass@8 after", lambda r: fmt_value((r["after"] or {}).get("pass@8"))),
            ("mean reward, last 10 steps", lambda r: fmt_value(r["reward_last10"])),
            ("rollout tokens trained on", lambda r: str(r["rollout_tokens"])),
            ("sequences spanning 2+ versions", spanning),
            ("  per second of training", lambda r: fmt_value(r["rollout_tokens_per_s"], "{:.1f}")),
            ("time to target", ttt),
            ("  of which after the 1st step", ttt_after_first),
        ],
    )
    print()
    print_curves(results, "held-out pass@1 by step (seconds since the start of the run):")
    print()
    ratios: dict[str, float | None] = {}
    first, second = (label for label, _ in modes)
    for key, name in (
        ("step_interval_median", "median interval"),
        ("step_interval_mean", "mean interval"),
        ("seconds_per_step_total", "train_seconds/steps"),
    ):
        a, s = asyn[key], sync[key]
        ratios[key] = (s / a) if a and s else None
        ratio = fmt_value(ratios[key], "{:.2f}x")
        print(f"{second} speed-up per step ({name}): {first} / {second} = {ratio}{mark}")
    a, s = asyn["rollout_tokens_per_s"], sync["rollout_tokens_per_s"]
    ratios["rollout_tokens_per_s"] = a / s if a and s else None
    print(
        f"rollout tokens trained on per second: {second} / {first} = "
        f"{fmt_value(ratios['rollout_tokens_per_s'], '{:.2f}x')}{mark}"
    )
    ta, ts = asyn["time_to_target"], sync["time_to_target"]
    ratios["time_to_target"] = ts["seconds"] / ta["seconds"] if ta and ts else None
    print(
        f"{second} speed-up to the target: {first} time / {second} time = "
        + (
            fmt_value(ratios["time_to_target"], "{:.2f}x")
            if ratios["time_to_target"] is not None
            else f"n/a ({first} {ttt(sync)}, {second} {ttt(asyn)})"
        )
        + mark
    )
    print(f"peak RSS of this process: {peak_rss_bytes() / 2**20:.0f} MiB")
    out = {
        "preset": args.preset,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "compare": args.compare,
        "pin": pin,
        "target": target,
        "cpu_count": os.cpu_count(),
        "busy_cores_before": busy,
        "machine_load": {"before": load_before, "after": load_after},
        "modes": results,
        "ratios": ratios,
    }
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=2)
        log.info("wrote %s", args.json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
