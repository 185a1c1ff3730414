"""The real controller in a process of its own: ``Controller`` over an ``HttpWorkerPool`` (the
workers file the simulation rewrites as workers come and go) and a ``TrainerClient`` to the fake
trainer, driven the way `rlax controller` drives it. Only the prompts and the scorer are made up
(no tokenizer, no verifier). It times every pool call and every snapshot, and reports them with
its counters when told to stop."""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import resource
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

STATUS_EVERY_S = 2.0
FEED_CLOSE_S = 30.0  # at the end, the longest wait for the pool's polls to come back
PROMPT_CHARS = 200  # a prompt's text; one token per 3 characters


@dataclasses.dataclass(frozen=True)
class ControllerHostSettings:
    token: str
    trainer_url: str
    workers_file: str
    run_dir: str
    prompts_per_step: int
    max_outstanding_groups: int
    group_size: int = 8
    max_new_tokens: int = 448
    groups_per_worker: int = 1
    reload_every: int = 1
    max_staleness: int | None = 1
    worker_timeout_s: float = 300.0
    seed: int = 0
    profile: str | None = None  # write the controller process's cProfile stats here


class SimPrompts:
    """A prompt source of a million made-up prompts (the controller's ``PromptSource``)."""

    def __len__(self) -> int:
        return 1_000_000

    def get(self, index: int) -> tuple[str, str]:
        words = " ".join(f"w{(index * 7919 + k) % 10007}" for k in range(PROMPT_CHARS // 6))
        return f"problem {index}: {words}", str(index % 10)


def encode(content: Any) -> list[int]:
    """A prompt's tokens: one per 3 characters, deterministic."""
    data = str(content).encode()
    return [1] + [3 + zlib.crc32(data[i : i + 3]) % 30_000 for i in range(0, len(data), 3)]


class SimScorer:
    """Rewards 0 or 1 by a hash of the prompt and the sample (the ``Scorer`` protocol)."""

    def score(self, prompts: Sequence[Any], results: Sequence[Any]) -> list[list[float]]:
        return [
            [float(zlib.crc32(f"{p.id}:{i}".encode()) % 2) for i in range(len(r.completions))]
            for p, r in zip(prompts, results, strict=True)
        ]


def timed_pool_class() -> type:
    """``HttpWorkerPool`` with every call the controller makes timed (seconds per call, by
    kind: submit, reset and progress are requests to a worker, progress_many a snapshot's
    questions to every holder at once; results takes what the worker's feed brought back)
    and the groups it handed to the controller counted."""
    from rlax_tasks.controller.service import HttpWorkerPool

    class TimedPool(HttpWorkerPool):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.seconds: dict[str, list[float]] = collections.defaultdict(list)
            self.failed: collections.Counter[str] = collections.Counter()
            self.received = 0  # groups handed back by results()
            self._lock = threading.Lock()  # (a thread-safe record)

        def _timed(self, kind: str, call: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return call()
            except Exception:
                with self._lock:
                    self.failed[kind] += 1
                raise
            finally:
                seconds = time.perf_counter() - t0
                with self._lock:
                    self.seconds[kind].append(seconds)

        def submit(self, worker_id: str, groups: Any) -> None:
            self._timed("submit", lambda: super(TimedPool, self).submit(worker_id, groups))

        def results(self, worker_id: str) -> Any:
            out = self._timed("results", lambda: super(TimedPool, self).results(worker_id))
            self.received += len(out)
            return out

        def reset(self, worker_id: str) -> None:
            self._timed("reset", lambda: super(TimedPool, self).reset(worker_id))

        def progress(self, worker_id: str) -> Any:
            return self._timed("progress", lambda: super(TimedPool, self).progress(worker_id))

        def progress_many(self, worker_ids: Any, deadline_s: float | None = None) -> Any:
            many = super().progress_many
            return self._timed("progress_many", lambda: many(worker_ids, deadline_s))

    return TimedPool


def _snapshot_files(run_dir: str, path: str) -> int:
    """Bytes of the snapshot whose JSON is ``path`` (with its Parquet files)."""
    stem = path[: -len(".json")]
    return sum(
        os.path.getsize(p)
        for p in (path, stem + ".buffer.parquet", stem + ".partials.parquet")
        if os.path.exists(p)
    )


def build(settings: ControllerHostSettings) -> tuple[Any, Any, list[dict[str, Any]]]:
    """The controller, its timed pool, and the list its snapshots are recorded in."""
    from rlax_tasks.controller import Controller, ControllerSettings, PromptMixture
    from rlax_tasks.controller.mixture import MixtureComponent
    from rlax_tasks.rollout.requests import SamplingParams
    from rlax_tasks.trainer.service import TrainerClient

    s = settings
    mixture = PromptMixture([MixtureComponent("sim", 1.0, SimPrompts())], s.seed)
    controller_settings = ControllerSettings(
        prompts_per_step=s.prompts_per_step,
        group_size=s.group_size,
        sampling=SamplingParams(max_new_tokens=s.max_new_tokens, temperature=1.0),
        groups_per_worker=s.groups_per_worker,
        reload_every=s.reload_every,
        max_staleness=s.max_staleness,
        dynamic_sampling=False,
        max_outstanding_groups=s.max_outstanding_groups,
        worker_timeout_s=s.worker_timeout_s,
        seed=s.seed,
        scoring_threads=1,
    )
    pool = timed_pool_class()(s.workers_file, token=s.token)
    trainer = TrainerClient(s.trainer_url, s.token)
    controller = Controller(
        controller_settings, mixture, pool, SimScorer(), trainer, encode, s.run_dir
    )
    snapshots: list[dict[str, Any]] = []
    _time_snapshots(controller, snapshots)
    return controller, pool, snapshots


def _time_snapshots(controller: Any, records: list[dict[str, Any]]) -> None:
    """Records per snapshot: groups in flight, seconds in all, asking the workers for their
    partial rollouts (``gather``: workers asked, and answered within its deadline) and writing
    and committing the files (``write``), bytes."""
    snapshot, write = controller.snapshot, controller.store.write
    gather = controller.partials.gather
    current: dict[str, Any] = {}

    def timed_gather(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            report = gather(*args, **kwargs)
            current["asked"] = current.get("asked", 0) + report.asked
            current["answered"] = current.get("answered", 0) + report.answered
            return report
        finally:
            current["gather_s"] = current.get("gather_s", 0.0) + time.perf_counter() - t0

    def timed_write(snap: Any) -> str:
        t0 = time.perf_counter()
        path = write(snap)
        current["write_s"] = time.perf_counter() - t0
        current["bytes"] = _snapshot_files(controller.run_dir, path)
        current["partial_rows"] = len(snap.partials)
        current["buffered"] = len(snap.buffer.get("groups", ()))
        return path

    def timed_snapshot(*args: Any, **kwargs: Any) -> Any:
        current.clear()
        current["in_flight"] = len(controller.in_flight_ids)
        t0 = time.perf_counter()
        out = snapshot(*args, **kwargs)
        current["total_s"] = time.perf_counter() - t0
        current["step"] = controller.step
        current["pending"] = kwargs.get("pending") is not None or bool(args)
        records.append(dict(current))
        return out

    controller.snapshot = timed_snapshot
    controller.partials.gather = timed_gather
    controller.store.write = timed_write


def controller_main(conn: Any, settings: ControllerHostSettings) -> None:
    """Runs the controller until told "stop" on ``conn`` (and takes a snapshot when told
    "snapshot"); sends a status line every few seconds, then its final report."""
    import pyarrow.parquet  # noqa: F401  (loaded once, at start-up, not in the first snapshot)

    controller, pool, snapshots = build(settings)
    profiler = None
    if settings.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    started = time.monotonic()
    controller.start()
    last = time.monotonic()
    error = None
    try:
        while True:
            if conn.poll():
                command = conn.recv()
                if command != "snapshot":  # "stop"
                    break
                controller.snapshot()  # a snapshot now, as at a reload boundary
            if not controller.iterate():
                time.sleep(0.02)
            if time.monotonic() - last >= STATUS_EVERY_S:
                last = time.monotonic()
                conn.send(("status", _status(controller, pool)))
    except Exception as e:  # reported, not lost in a child's stderr
        log.exception("the controller failed")
        error = repr(e)
    seconds = time.monotonic() - started
    conn.send(("closing", None))  # the simulation wakes the workers' open polls
    held = pool.close(wait_s=FEED_CLOSE_S)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(settings.profile)
    controller.close()
    report = {
        "status": _status(controller, pool),
        "seconds": seconds,
        "calls": {k: v for k, v in pool.seconds.items()},
        "failed_calls": dict(pool.failed),
        "received": pool.received,
        "dropped_by_pool": pool.dropped_results,
        "held_by_pool": held,
        "snapshots": snapshots,
        "phases": dict(controller.phases.totals),
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "oldest_in_flight": _oldest_in_flight(controller),
        "error": error,
    }
    conn.send(("final", json.loads(json.dumps(report, default=float))))


def _oldest_in_flight(controller: Any, count: int = 5) -> list[dict[str, Any]]:
    """The groups in flight longest: prompt id, worker, seconds since they were sent."""
    now = time.monotonic()
    entries = sorted(controller._in_flight.values(), key=lambda e: e.sent)[:count]
    return [{"prompt_id": e.prompt.id, "worker": e.worker, "age_s": now - e.sent} for e in entries]


def _status(controller: Any, pool: Any) -> dict[str, Any]:
    return {**controller.status(), "received": pool.received, "calls": sum(
        len(v) for v in pool.seconds.values())}  # fmt: skip
