"""The trainer: old-policy prefill, RL objective, micro-batched Optax updates over a device mesh,
Orbax checkpoints and per-step metrics (DESIGN §4, §5, §7)."""

from rlax_tasks.trainer.checkpointing import Checkpointer, is_complete_checkpoint
from rlax_tasks.trainer.config import TrainerConfig, TrainerConfigError
from rlax_tasks.trainer.metrics import MetricsWriter, read_metrics
from rlax_tasks.trainer.optimizer import learning_rate_schedule, make_optimizer
from rlax_tasks.trainer.train_step import BATCH_KEYS, StepSettings, make_train_step
from rlax_tasks.trainer.trainer import BatchFormatError, RestoredCheckpoint, Trainer, build_mesh

__all__ = [
    "BATCH_KEYS",
    "BatchFormatError",
    "Checkpointer",
    "MetricsWriter",
    "RestoredCheckpoint",
    "StepSettings",
    "Trainer",
    "TrainerConfig",
    "TrainerConfigError",
    "build_mesh",
    "is_complete_checkpoint",
    "learning_rate_schedule",
    "make_optimizer",
    "make_train_step",
    "read_metrics",
]
