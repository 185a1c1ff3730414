"""The controller (DESIGN §2, §3, §7): prompt mixture, rollout buffer under the staleness rules,
snapshots, lineage, and the decision loop that ties them to workers, verifiers and the trainer."""

from rlax_tasks.controller.buffer import (
    Batch,
    DroppedGroup,
    RolloutBuffer,
    ScoredGroup,
    SkippedPrompt,
)
from rlax_tasks.controller.controller import (
    Controller,
    ControllerSettings,
    Scorer,
    ScorerError,
    TrainerBehindError,
    TrainStep,
    WorkerError,
    WorkerPool,
)
from rlax_tasks.controller.lineage import LineageWriter, lineage_record, read_lineage
from rlax_tasks.controller.mixture import MixtureComponent, Prompt, PromptMixture, make_source
from rlax_tasks.controller.rollouts import read_rollouts
from rlax_tasks.controller.snapshot import Snapshot, SnapshotError, SnapshotStore
from rlax_tasks.controller.staleness import should_reload, within_staleness

__all__ = [
    "Batch",
    "Controller",
    "ControllerSettings",
    "DroppedGroup",
    "LineageWriter",
    "MixtureComponent",
    "Prompt",
    "PromptMixture",
    "RolloutBuffer",
    "ScoredGroup",
    "Scorer",
    "SkippedPrompt",
    "ScorerError",
    "Snapshot",
    "SnapshotError",
    "SnapshotStore",
    "TrainStep",
    "TrainerBehindError",
    "WorkerError",
    "WorkerPool",
    "lineage_record",
    "make_source",
    "read_lineage",
    "read_rollouts",
    "should_reload",
    "within_staleness",
]
