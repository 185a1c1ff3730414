"""What the controller talks to: the worker pool, the scorer and the trainer, as small protocols
and the errors that mark a failure of each; the process wiring adapts HTTP clients to them,
tests pass deterministic fakes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rlax_tasks.controller.buffer import Batch
from rlax_tasks.controller.mixture import Prompt
from rlax_tasks.rollout.requests import GroupRequest, GroupResult, SampleProgress


class WorkerError(RuntimeError):
    """A worker failed (adapters raise it, or ConnectionError / TimeoutError / OSError)."""


class LateAnswer(TimeoutError):
    """A worker had not answered when the caller's deadline passed (its request was cut)."""


class ScorerError(RuntimeError):
    """The scorer (verifier) failed; the groups are kept and scored again later."""


WORKER_ERRORS = (WorkerError, ConnectionError, TimeoutError, OSError)
SCORER_ERRORS = (ScorerError, ConnectionError, TimeoutError, OSError)


class WorkerPool(Protocol):
    """The inference fleet as the controller sees it; workers may join or leave at any time."""

    def worker_ids(self) -> list[str]:
        """The workers that can take work now, in a stable order."""
        ...

    def submit(self, worker_id: str, groups: Sequence[GroupRequest]) -> None: ...

    def results(self, worker_id: str) -> list[GroupResult]:
        """Finished groups of that worker (possibly none); raises a WORKER_ERRORS on failure."""
        ...

    def reset(self, worker_id: str) -> None:
        """Drops all work of that worker."""
        ...

    def progress(self, worker_id: str) -> dict[str, list[SampleProgress]]:
        """What that worker's unfinished groups hold so far, per prompt id (finished samples
        and the tokens of those in flight); raises a WORKER_ERRORS on failure."""
        ...

    # A pool may also offer ``progress_many(worker_ids, deadline_s) -> {worker: report or
    # error}``, asking them all at once and giving up on those that have not answered by the
    # deadline (``LateAnswer``); the controller's snapshot uses it when there
    # (controller/partials.py).


class Scorer(Protocol):
    """Verifier verdicts: one list of G scores per (prompt, result) pair; a score is a reward
    (float) or has ``.reward`` and ``.verdict`` (``rlax_tasks.rewards.scoring.SampleScore``)."""

    def score(
        self, prompts: Sequence[Prompt], results: Sequence[GroupResult]
    ) -> list[list[Any]]: ...


# the trainer side: trains on a batch, pushes the new weights and returns their version; it
# raises TrainerBehindError when it restarted from a checkpoint older than the previous step,
# and may raise StepReplayedError when it had applied the step already (a replay, not applied)
TrainStep = Callable[[Batch], int]
