"""Errors that cross the wire between the controller and the trainer: defined once, here.

The trainer raises them as HTTP 409; its client raises ``TrainerBehindError`` again for the
controller, which replays the lost steps. ``StepReplayedError``: a step answered as a replay
that the client had not sent. Importable without JAX, FastAPI or either package."""

from __future__ import annotations


class StepConflictError(ValueError):
    """The controller sent a step the trainer cannot apply (not the next one, not a replay)."""


class TrainerBehindError(RuntimeError):
    """The trainer restarted from the checkpoint of ``trainer_step``, before the step asked for.

    The trainer checkpoints every ``trainer.checkpoint_every`` steps; the controller then gives
    it the steps since that checkpoint again, rebuilt from ``rollouts/`` (docs/design.md §7).
    """

    def __init__(self, trainer_step: int, message: str = "") -> None:
        super().__init__(message or f"the trainer is at step {trainer_step}")
        self.trainer_step = trainer_step


class StepAheadError(StepConflictError, TrainerBehindError):
    """``TrainerBehindError`` as the trainer service raises it: the step sent is more than one
    past the trainer's ``trainer_step``, so it is also a ``StepConflictError`` (409)."""

    def __init__(self, trainer_step: int, message: str = "") -> None:
        TrainerBehindError.__init__(self, trainer_step, message)  # (ValueError's comes first)


class StepReplayedError(RuntimeError):
    """The trainer answered step ``step`` as a replay: it had applied that step before.

    Normal only when the controller sent that step before (it restarted after the trainer
    applied it); for a step the controller never sent, someone else trained the policy.
    """

    def __init__(self, step: int, version: int, metrics: dict | None = None) -> None:
        super().__init__(f"the trainer had already applied step {step} (version {version})")
        self.step, self.version, self.metrics = step, version, metrics
