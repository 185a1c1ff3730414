"""The controller (docs/design.md §2, §3, §7): prompt mixture, rollout buffer under the staleness
rules, snapshots, lineage, and the decision loop that ties them to workers, verifiers and the
trainer."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Batch": ".buffer",
        "Controller": ".controller",
        "ControllerSettings": ".settings",
        "DroppedGroup": ".buffer",
        "LineageWriter": ".lineage",
        "MixtureComponent": ".mixture",
        "Prompt": ".mixture",
        "PromptMixture": ".mixture",
        "RolloutBuffer": ".buffer",
        "ScoredGroup": ".buffer",
        "Scorer": ".ports",
        "ScorerError": ".ports",
        "SkippedPrompt": ".buffer",
        "Snapshot": ".snapshot",
        "SnapshotError": ".snapshot",
        "SnapshotStore": ".snapshot",
        "TrainStep": ".ports",
        "TrainerBehindError": "rlax_tasks.services.protocol",
        "WorkerError": ".ports",
        "WorkerPool": ".ports",
        "lineage_record": ".lineage",
        "make_source": ".mixture",
        "read_lineage": ".lineage",
        "read_rollouts": ".rollouts",
    },
)
