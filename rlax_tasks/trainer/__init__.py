"""The trainer: old-policy prefill, RL objective, micro-batched Optax updates over a device mesh,
Orbax checkpoints and per-step metrics (docs/design.md §4, §5, §7)."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "BATCH_KEYS": ".train_step",
        "BatchFormatError": ".batch_format",
        "Checkpointer": ".checkpointing",
        "MetricsWriter": ".metrics",
        "RestoredCheckpoint": ".trainer",
        "StepSettings": ".train_step",
        "Trainer": ".trainer",
        "TrainerConfig": ".config",
        "TrainerConfigError": ".config",
        "build_mesh": ".trainer",
        "is_complete_checkpoint": ".checkpointing",
        "learning_rate_schedule": ".optimizer",
        "make_optimizer": ".optimizer",
        "make_train_step": ".train_step",
        "read_metrics": ".metrics",
    },
)
