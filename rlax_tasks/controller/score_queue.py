"""Generated groups on their way to the buffer (docs/design.md §2): handed to the scorer, on its
threads when it has any, and buffered in the order they arrived; a failed job is tried again."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

from rlax_tasks.controller.mixture import Prompt
from rlax_tasks.controller.ports import SCORER_ERRORS, Scorer
from rlax_tasks.controller.scoring import environment_scores
from rlax_tasks.rollout.requests import GroupResult

log = logging.getLogger(__name__)

Item = tuple[Prompt, GroupResult]


class ScoreQueue:
    """The groups between a worker and the buffer: ``put`` what came back, ``advance`` once a
    round; each scored group goes to ``add(prompt, result, scores)``, in arrival order.

    ``threads``: scoring jobs in flight beside the caller's thread (0: scored inline);
    ``counters``: where ``scorer_failures`` is counted."""

    def __init__(
        self,
        scorer: Scorer,
        threads: int,
        add: Callable[[Prompt, GroupResult, Sequence[Any]], None],
        counters: collections.Counter[str],
    ) -> None:
        self.scorer, self.threads, self._add, self.counters = scorer, threads, add, counters
        self._unscored: list[Item] = []  # not handed to the scorer yet
        self._jobs: list[tuple[list[Item], Future]] = []  # on the threads, in order
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="rlax-score") if threads else None
        )

    def put(self, prompt: Prompt, result: GroupResult) -> None:
        """Queues a generated group for scoring."""
        self._unscored.append((prompt, result))

    def pending(self) -> list[Item]:
        """Generated groups not scored yet (those being scored first, in order)."""
        return [item for items, _ in self._jobs for item in items] + self._unscored

    def advance(self) -> None:
        """Buffers the scores of finished jobs, in the order they were handed over, then hands
        the unscored groups to the scorer (inline, or to a free thread)."""
        while self._jobs and self._jobs[0][1].done():
            items, job = self._jobs.pop(0)
            try:
                self._buffer(items, job.result())
            except SCORER_ERRORS as e:
                self._failed(items, e)
        if not self._unscored:
            return
        items, self._unscored = self._unscored, []
        # episode groups come scored by their environment; the others go to the scorer
        episodes = [(item, environment_scores(item[1])) for item in items]
        scored = [(item, s) for item, s in episodes if s is not None]
        if scored:
            self._buffer([item for item, _ in scored], [s for _, s in scored])
        items = [item for item, s in episodes if s is None]
        if not items:
            return
        prompts, results = [p for p, _ in items], [r for _, r in items]
        if self._pool is None:
            try:
                self._buffer(items, self.scorer.score(prompts, results))
            except SCORER_ERRORS as e:
                self._failed(items, e)
        elif len(self._jobs) < self.threads:
            self._jobs.append((items, self._pool.submit(self.scorer.score, prompts, results)))
        else:
            self._unscored = items  # every scoring thread is busy: next round

    def wait(self, timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` for the oldest job on the threads to end; False at once
        when none runs."""
        if not self._jobs:
            return False
        futures_wait([self._jobs[0][1]], timeout=timeout_s)
        return True

    def close(self) -> None:
        """Stops the scoring threads (a job under way finishes first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _failed(self, items: list[Item], e: Exception) -> None:
        self.counters["scorer_failures"] += 1
        log.warning("scoring %d groups failed (%s); retrying next round", len(items), e)
        self._unscored = items + self._unscored

    def _buffer(self, items: list[Item], scores: Sequence[Any]) -> None:
        if len(scores) != len(items):
            raise RuntimeError(
                f"the scorer returned {len(scores)} score lists for {len(items)} groups"
            )
        for (p, r), s in zip(items, scores, strict=True):
            self._add(p, r, s)
