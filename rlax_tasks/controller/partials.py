"""Partial rollouts (docs/design.md §7): what the in-flight groups held when the controller last
asked their workers, kept in snapshots and handed back when a group is issued again (a failed
worker, a restarted run), so tokens already generated are not generated again."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rlax_tasks.controller.ports import WORKER_ERRORS, LateAnswer, WorkerPool
from rlax_tasks.rollout.requests import SampleProgress

log = logging.getLogger(__name__)

GATHER_THREADS = 32  # workers asked at once for their progress at a snapshot (without a loop)
# how long a snapshot waits for its workers' answers over the network: one still busy past it (a
# compile, a long decode chunk, a starved host) keeps its older records, and the controller's
# rounds go on (a snapshot of a thousand workers in flight commits within a second)
GATHER_DEADLINE_S = 0.8


@dataclasses.dataclass(frozen=True)
class GatherReport:
    """How a snapshot's question went: workers asked, too late, failed (the rest answered)."""

    asked: int = 0
    late: int = 0
    failed: int = 0

    @property
    def answered(self) -> int:
        return self.asked - self.late - self.failed


class PartialRollouts:
    """Per in-flight prompt id, the newest record of its samples (``SampleProgress``)."""

    def __init__(self) -> None:
        self._held: dict[str, list[SampleProgress]] = {}

    def gather(
        self,
        pool: WorkerPool,
        holders: dict[str, Iterable[str]],
        deadline_s: float = GATHER_DEADLINE_S,
    ) -> GatherReport:
        """Asks each worker in ``holders`` (worker -> the prompt ids it holds) what its groups
        hold now, all at once, waiting at most ``deadline_s``; a worker that does not answer by
        then keeps its older records."""
        workers = list(holders)
        if not workers:
            return GatherReport()
        late = failed = 0
        for worker, report in self._ask(pool, workers, deadline_s).items():
            if isinstance(report, Exception):  # busy (a compile) or down: older records stand
                late += isinstance(report, LateAnswer)
                failed += not isinstance(report, LateAnswer)
                log.debug("no progress report from worker %s (%s)", worker, report)
                continue
            for prompt_id in holders[worker]:
                if report.get(prompt_id):
                    self._held[prompt_id] = list(report[prompt_id])
        out = GatherReport(len(workers), late, failed)
        if late or failed:
            log.info(
                "progress of %d workers: %d answered, %d not within %.1f s, %d failed (their "
                "older records stand)", out.asked, out.answered, late, deadline_s, failed,
            )  # fmt: skip
        return out

    @staticmethod
    def _ask(pool: WorkerPool, workers: list[str], deadline_s: float) -> dict[str, Any]:
        """Per worker, its progress report or the error it met: through the pool's own
        ``progress_many`` when it has one (workers over the network, asked from one event loop
        until the deadline), else from a few threads (workers in this process: all answer)."""
        if hasattr(pool, "progress_many"):
            return pool.progress_many(workers, deadline_s)

        def ask(worker: str) -> Any:
            try:
                return pool.progress(worker)
            except WORKER_ERRORS as e:
                return e

        threads = min(len(workers), GATHER_THREADS)
        with ThreadPoolExecutor(threads, thread_name_prefix="rlax-progress") as executor:
            return dict(zip(workers, executor.map(ask, workers), strict=True))

    def resume(self, prompt_id: str, min_version: int) -> tuple[SampleProgress, ...]:
        """The records to issue ``prompt_id`` with, still held until its group comes back (a
        worker that fails before the next report loses nothing held): those with a token
        older than ``min_version`` are left out (the group would be too stale to train on)."""
        records = self._held.get(prompt_id, [])
        return tuple(r for r in records if min(r.versions or [min_version]) >= min_version)

    def drop(self, prompt_id: str) -> None:
        """Forgets a prompt's records (its group came back, or it was skipped)."""
        self._held.pop(prompt_id, None)

    def rows(self, prompt_ids: Iterable[str]) -> list[dict[str, Any]]:
        """The records of ``prompt_ids`` as snapshot rows (one per sample)."""
        return [{"prompt_id": p, **r.to_dict()} for p in prompt_ids for r in self._held.get(p, [])]

    def load(self, rows: Iterable[dict[str, Any]]) -> None:
        """Holds a snapshot's rows (``rows``) in place of anything held."""
        self._held = {}
        for row in rows:
            row = dict(row)
            prompt_id = row.pop("prompt_id")
            record = SampleProgress.from_dict(row, 1 << 30, 1 << 62)
            self._held.setdefault(prompt_id, []).append(record)
