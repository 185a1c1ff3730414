"""Recovery (docs/design.md §7): from a restored snapshot and lineage.jsonl back to the run's state.

Functions the controller calls on restart: which prompts go back to which worker, the lineage
lines to put back, the steps trained after an older snapshot (rolled forward), and the steps a
trainer restored from an older checkpoint is given again from ``rollouts/``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from rlax_tasks.controller.buffer import Batch, RolloutBuffer
from rlax_tasks.controller.lineage import LineageWriter, recovered_record
from rlax_tasks.controller.mixture import Prompt, PromptMixture
from rlax_tasks.controller.ports import TrainStep
from rlax_tasks.controller.rollouts import read_step_batch, rollouts_dir
from rlax_tasks.controller.snapshot import Snapshot
from rlax_tasks.rundir import notices
from rlax_tasks.services.protocol import StepReplayedError

log = logging.getLogger(__name__)


def check_seed(snap: Snapshot, seed: int) -> None:
    """Raises when the snapshot belongs to a run with another seed."""
    if snap.seed != seed:
        raise ValueError(
            f"snapshot of step {snap.step} is for seed {snap.seed}, the run has seed "
            f"{seed}: resume with the run's own configuration"
        )


def restore_lineage(run_dir: str, lineage: LineageWriter, snap: Snapshot) -> None:
    """Puts back the lineage lines of steps the snapshot counts as trained that
    lineage.jsonl lacks (a line cut short or lost), from ``rollouts/`` or the snapshot."""
    missing = [k for k in range(1, snap.step + 1) if not lineage.has(k)]
    if not missing:
        return
    listed = {s["step"]: s["prompt_ids"] for s in snap.steps}
    records = [recovered_record(run_dir, k, listed.get(k)) for k in missing]
    restored = lineage.restore([r for r in records if r is not None])
    lost = [k for k, r in zip(missing, records, strict=True) if r is None]
    if lost:
        log.warning(
            "lineage.jsonl has no line for trained steps %s and neither rollouts/ nor the "
            "snapshot records them: left out", steps_text(lost),
        )  # fmt: skip
    if restored:
        notices.post(
            run_dir,
            "fallback",
            f"lineage.jsonl had no complete line for step(s) {steps_text(restored)}, which "
            f"the snapshot of step {snap.step} counts as trained: restored from rollouts/ "
            '(or the snapshot), marked "restored"',
            source="controller",
        )


def committed_after(lineage: LineageWriter, snap: Snapshot) -> list[dict[str, Any]]:
    """The lineage records of steps trained after ``snap`` that its pending replay does not
    cover: non-empty only when ``snap`` is older than the newest state (a damaged newer
    snapshot was set aside)."""
    later = sorted((r for r in lineage.records if r["step"] > snap.step), key=lambda r: r["step"])
    steps = [r["step"] for r in later]
    if steps != list(range(snap.step + 1, snap.step + 1 + len(steps))):
        raise RuntimeError(
            f"{lineage.path} records steps {steps_text(steps)} after the snapshot's "
            f"step {snap.step}, with gaps: remove the lines after the first gap to resume"
        )
    if snap.pending is not None and steps == [snap.step + 1]:
        return []  # the pending step itself: replayed as usual
    return later


@dataclasses.dataclass
class Reissue:
    """Where a snapshot's prompts go: ``queued`` front first (in-flight prompts of workers
    that are gone, then the snapshot's queue), ``by_worker`` the in-flight prompts of each
    live worker, in dispatch order."""

    queued: list[Prompt]
    by_worker: dict[str, list[Prompt]]


def reissue(
    snap: Snapshot, mixture: PromptMixture, live: Sequence[str], trained: set[str]
) -> Reissue:
    """The snapshot's queued and in-flight prompts, less those ``trained`` since: each
    in-flight one back to the same worker when it is still live, else to the queue front."""
    by_worker: dict[str, list[Prompt]] = {w: [] for w in live}
    orphans: list[Prompt] = []
    for item in snap.in_flight:
        if item["prompt_id"] in trained:
            continue
        prompt = mixture.prompt(item["prompt_id"], item["seq"])
        by_worker.get(item["worker"], orphans).append(prompt)
    queued = [
        mixture.prompt(q["prompt_id"], q["seq"])
        for q in snap.queued
        if q["prompt_id"] not in trained
    ]
    return Reissue(orphans + queued, {w: ps for w, ps in by_worker.items() if ps})


@dataclasses.dataclass
class RollForward:
    """The state after the steps trained since an older snapshot: prompts drawn again to
    queue (in draw order), how many draws it took, the last step and its version."""

    queued: list[Prompt]
    draws: int
    step: int
    version: int
    trained_groups: int
    steps: list[dict[str, Any]]


def roll_forward(
    snap: Snapshot,
    later: list[dict[str, Any]],
    trained: set[str],
    buffer: RolloutBuffer,
    mixture: PromptMixture,
    usable: Callable[[Prompt], bool],
    budget: int,
) -> RollForward:
    """Brings a restored older snapshot up to the steps trained since (``later``, from
    lineage.jsonl): their prompts leave the buffer, the prompts drawn after the snapshot are
    drawn again (the trained ones passed over, the ``usable`` others queued). The trainer
    holds those steps, or is given them again from ``rollouts/`` (``TrainerBehindError``)."""
    state = buffer.state_dict()
    known = {g["prompt_id"] for g in state["groups"]}
    known |= {q["prompt_id"] for q in snap.queued} | set(snap.in_flight_ids)
    # the drops and skips before the first of these steps are in its lineage line already
    buffer.load_state_dict(
        {
            **state,
            "groups": [g for g in state["groups"] if g["prompt_id"] not in trained],
            "dropped": [],
            "skipped": [],
        }
    )
    ahead = trained - known  # drawn after the snapshot, trained since
    limit = len(ahead) + max(64, 4 * budget) * (len(later) + 1)
    queued: list[Prompt] = []
    draws = 0
    while ahead and draws < limit:
        prompt = mixture.next()
        draws += 1
        if prompt.id in ahead:
            ahead.discard(prompt.id)
        elif usable(prompt):  # (an unusable one was skipped back then)
            queued.append(prompt)
    if ahead:
        log.warning(
            "%d prompts trained after the snapshot of step %d were not drawn again within "
            "%d draws; they may be drawn again later", len(ahead), snap.step, draws,
        )  # fmt: skip
    last = later[-1]
    log.warning(
        "the snapshot of step %d is older than lineage.jsonl: steps %s were trained after "
        "it; continuing from step %d", snap.step, steps_text([r["step"] for r in later]),
        last["step"],
    )  # fmt: skip
    return RollForward(
        queued=queued,
        draws=draws,
        step=int(last["step"]),
        version=int(last["version"]),
        trained_groups=sum(len(r["prompt_ids"]) for r in later),
        steps=[{"step": r["step"], "prompt_ids": r["prompt_ids"]} for r in later],
    )


def check_pending(snap: Snapshot, batch: Batch | None) -> Batch:
    """The batch the restored buffer forms for the snapshot's pending step; raises when it is
    not the batch the snapshot recorded (the snapshot is inconsistent)."""
    if batch is None or batch.prompt_ids != snap.pending:
        pending = snap.pending or []
        raise RuntimeError(
            f"snapshot of step {snap.step} records a pending batch {pending[:3]}... "
            "that its buffer does not reproduce: the snapshot is inconsistent"
        )
    return batch


def send_step(train_step: TrainStep, batch: Batch, step: int, sent_before: bool) -> int:
    """``train_step(batch)``: the version it produced. A replay answer (the trainer had
    applied the step already) stands only for a step this controller sent before; for any
    other, someone else trained the policy on their own batch, and the run stops here."""
    try:
        return train_step(batch)
    except StepReplayedError as e:
        if sent_before:
            log.info("the trainer had applied step %d already: replayed, not applied", step)
            return e.version
        log.error(
            "the trainer answered step %d as already applied, but this controller never "
            "sent it (not the pending step of its snapshot, not in lineage.jsonl): someone "
            "else trained the policy; stopping",
            step,
        )
        raise RuntimeError(
            f"the trainer had already applied step {step}, which this controller never "
            "sent: the policy was trained on a batch from elsewhere. Stop the run, check "
            "who holds the run's token, and resume from a checkpoint before that step"
        ) from e


def replay_steps(run_dir: str, trainer_step: int, step: int, train_step: TrainStep) -> int:
    """Gives a trainer restored at ``trainer_step`` the steps after it, up to ``step``, again;
    each is rebuilt from ``rollouts/step-<k>``, the exact arrays it trained on. Returns how
    many steps were replayed."""
    if not 0 <= trainer_step < step:
        raise RuntimeError(
            f"the trainer reports step {trainer_step}, the controller is at step {step}"
        )
    log.warning(
        "the trainer restarted from its checkpoint of step %d: replaying steps %d-%d from %s",
        trainer_step,
        trainer_step + 1,
        step,
        rollouts_dir(run_dir),
    )
    for k in range(trainer_step + 1, step + 1):
        version = send_step(train_step, read_step_batch(run_dir, k), k, sent_before=True)
        if version != k:
            raise RuntimeError(f"replayed step {k} produced version {version}, not {k}")
    return step - trainer_step


def steps_text(steps: Sequence[int]) -> str:
    """A short list of step numbers for messages."""
    steps = list(steps)
    if len(steps) > 6:
        return f"{', '.join(map(str, steps[:3]))}, ..., {steps[-1]} ({len(steps)} steps)"
    return ", ".join(map(str, steps))
