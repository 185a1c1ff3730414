"""Recovery from damaged state: a snapshot that does not verify (cut short, missing, altered),
a ``LATEST`` naming a missing file, a torn committed lineage line. The damaged files are set
aside (renamed, never deleted), the newest good state is used, a notice says so, and every
training step is applied exactly once."""

from __future__ import annotations

import json
import os

import pytest

from rlax_tasks.controller import SnapshotError, SnapshotStore, read_lineage
from rlax_tasks.controller.scoring import reward_and_verdict
from rlax_tasks.controller.snapshot import NoIntactSnapshotError
from rlax_tasks.rewards.scoring import SampleScore
from rlax_tasks.rundir import notices, storage
from rlax_tasks.services.protocol import StepConflictError
from tests.controller.fakes import FakeTrainer, World, controller
from tests.controller.test_controller import N, full_run
from tests.controller.test_snapshot import snap


class StrictTrainer(FakeTrainer):
    """The trainer service's rule: a step older than the trainer's is refused, never answered
    as a replay (a controller that fell back must not send steps the trainer is past)."""

    def __call__(self, batch) -> int:
        if batch.version < self.version:
            raise StepConflictError(f"step {batch.version} is older than {self.version}")
        return super().__call__(batch)


def _world() -> World:
    world = World()
    world.trainer = StrictTrainer()
    world.pool.trainer = world.trainer
    return world


def _stopped_at(run_dir: str, steps: int) -> World:
    """A run of the fakes stopped (kill -9 of the controller) after ``steps`` steps; the
    trainer and the workers live on."""
    world = _world()
    c = controller(run_dir, world)
    c.start()
    c.run(steps, max_iterations=500)
    return world


def _notices(run_dir: str, kind: str) -> list[str]:
    return [n.message for n in notices.read_since(run_dir)[0] if n.kind == kind]


def _snapshots(run_dir: str) -> list[str]:
    return storage.list_children(storage.join(run_dir, "snapshots"))


def _assert_every_step_once(run_dir: str, world: World) -> list[dict]:
    lineage = read_lineage(run_dir)
    assert [r["step"] for r in lineage] == list(range(1, N + 1))  # contiguous, each once
    assert [b.version for b in world.trainer.batches] == list(range(1, N + 1))  # applied once
    consumed = [p for r in lineage for p in r["prompt_ids"]]
    assert len(consumed) == len(set(consumed))  # no prompt trained twice either
    return lineage


def _truncate(path: str) -> None:
    data = storage.read_bytes(path)
    storage.write_bytes(path, data[: len(data) // 2])


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_a_damaged_newest_snapshot_falls_back_to_the_previous_one(tmp_path, damage):
    reference = str(tmp_path / "ref")
    full_run(reference)
    run_dir = str(tmp_path / "run")
    world = _stopped_at(run_dir, 6)  # the newest snapshot: 6.json (j = 2), LATEST names it
    newest = storage.join(run_dir, "snapshots", "6.json")
    if damage == "truncated":
        _truncate(newest)
    else:
        os.remove(newest)

    c = controller(run_dir, world)
    assert c.start() is True
    # the write-ahead snapshot before step 6 verifies: step 6 is re-sent, answered as a replay
    assert c.step == 6 and world.trainer.replays == 1
    c.run(N, max_iterations=500)
    assert _assert_every_step_once(run_dir, world) == read_lineage(reference)

    names = _snapshots(run_dir)
    if damage == "truncated":
        aside = [n for n in names if n.startswith("6.json.damaged-")]
        assert len(aside) == 1  # renamed, not deleted: its bytes are still there
        kept = storage.read_bytes(storage.join(run_dir, "snapshots", aside[0]))
        assert len(kept) > 0
    else:  # LATEST named a missing file: the old pointer is kept beside the new one
        assert any(n.startswith("LATEST.damaged-") for n in names)
    (message,) = _notices(run_dir, "fallback")
    assert "6.json" in message and "5.pending.json (step 5)" in message
    # LATEST was moved to the snapshot used: a second restart is clean, no second notice
    again = controller(run_dir, world)
    assert again.start() is True and again.step == N
    assert len(_notices(run_dir, "fallback")) == 1


def test_a_fallback_past_steps_the_trainer_applied_rolls_forward_without_resending_them(tmp_path):
    """The two newest snapshots are damaged: the controller falls back to the write-ahead one
    before step 5, although the trainer applied steps 5 and 6. It takes those steps from
    lineage.jsonl (their prompts are not trained again) and sends step 7 next."""
    run_dir = str(tmp_path / "run")
    world = _stopped_at(run_dir, 6)
    _truncate(storage.join(run_dir, "snapshots", "6.json"))
    _truncate(storage.join(run_dir, "snapshots", "5.pending.json"))

    c = controller(run_dir, world)
    assert c.start() is True
    assert c.step == 6 and world.trainer.replays == 0  # nothing re-sent (StrictTrainer)
    assert SnapshotStore(run_dir).load_latest().step == 6  # the rolled-forward state, committed
    c.run(N, max_iterations=500)
    _assert_every_step_once(run_dir, world)
    names = _snapshots(run_dir)
    assert any(n.startswith("6.json.damaged-") for n in names)
    assert any(n.startswith("5.pending.json.damaged-") for n in names)
    (message,) = _notices(run_dir, "fallback")
    assert "4.pending.json (step 4)" in message


def test_a_torn_committed_lineage_line_is_restored_not_dropped(tmp_path):
    reference = str(tmp_path / "ref")
    full_run(reference)
    run_dir = str(tmp_path / "run")
    world = _stopped_at(run_dir, 6)  # the snapshot of step 6 counts steps 5 and 6 as trained
    path = storage.join(run_dir, "lineage.jsonl")
    data = storage.read_bytes(path)
    last = data[:-1].rfind(b"\n") + 1
    storage.write_bytes(path, data[: last + (len(data) - last) // 2])  # step 6's line, torn

    c = controller(run_dir, world)
    assert c.start() is True and c.step == 6
    c.run(N, max_iterations=500)
    lineage = _assert_every_step_once(run_dir, world)
    want = read_lineage(reference)
    assert lineage[5]["restored"] == "rollouts"
    for key in ("prompt_ids", "rollout_versions", "version"):
        assert lineage[5][key] == want[5][key], key
    assert [r for i, r in enumerate(lineage) if i != 5] == [r for i, r in enumerate(want) if i != 5]
    (message,) = _notices(run_dir, "fallback")
    assert "step(s) 6" in message


def test_without_its_rollouts_file_a_lost_line_comes_from_the_snapshot(tmp_path):
    run_dir = str(tmp_path / "run")
    world = _stopped_at(run_dir, 6)
    full = read_lineage(run_dir)
    path = storage.join(run_dir, "lineage.jsonl")
    lines = storage.read_bytes(path).splitlines(keepends=True)
    storage.write_bytes(path, b"".join(lines[:4] + lines[5:]))  # step 5's line is gone
    os.remove(os.path.join(run_dir, "rollouts", "step-00000005.parquet"))
    c = controller(run_dir, world)
    c.start()
    lineage = read_lineage(run_dir)
    assert [r["step"] for r in lineage] == [1, 2, 3, 4, 5, 6]
    assert lineage[4]["restored"] == "snapshot"
    assert lineage[4]["prompt_ids"] == full[4]["prompt_ids"]


def test_an_unreadable_latest_pointer_uses_the_newest_snapshot_that_verifies(tmp_path):
    run_dir = str(tmp_path)
    store = SnapshotStore(run_dir)
    for step in (2, 4):
        store.write(snap(step))
    storage.write_bytes(store.pointer, b'{"step": 4, "fi')
    assert SnapshotStore(run_dir).load_latest() == snap(4)
    assert any(n.startswith("LATEST.damaged-") for n in _snapshots(run_dir))
    assert json.loads(storage.read_bytes(store.pointer))["file"] == "4.json"


def test_an_altered_older_snapshot_is_skipped_by_its_own_checksum(tmp_path):
    run_dir = str(tmp_path)
    store = SnapshotStore(run_dir)
    for step in (2, 4, 6):
        store.write(snap(step))
    older = storage.join(run_dir, "snapshots", "4.json")
    storage.write_bytes(older, storage.read_bytes(older).replace(b'"issued": 4', b'"issued": 5'))
    storage.delete_prefix(storage.join(run_dir, "snapshots", "6.json"))
    assert SnapshotStore(run_dir).load_latest() == snap(2)
    (message,) = _notices(run_dir, "fallback")
    assert "4.json does not match its own sha256" in message


def test_a_snapshot_without_its_own_checksum_still_loads(tmp_path):
    """Snapshots written before they carried their sha256 load as before."""
    run_dir = str(tmp_path)
    store = SnapshotStore(run_dir)
    store.write(snap(2))
    path = storage.join(run_dir, "snapshots", "2.json")
    body = json.loads(storage.read_bytes(path))
    del body["sha256"]
    payload = json.dumps(body, sort_keys=True).encode()
    storage.write_bytes(path, payload)
    import hashlib

    pointer = {"step": 2, "file": "2.json", "sha256": hashlib.sha256(payload).hexdigest()}
    storage.write_bytes(store.pointer, json.dumps(pointer).encode())
    assert SnapshotStore(run_dir).load_latest() == snap(2)
    assert not _notices(run_dir, "fallback")


def test_when_no_snapshot_verifies_the_error_says_what_to_do(tmp_path):
    run_dir = str(tmp_path)
    SnapshotStore(run_dir).write(snap(2))
    _truncate(storage.join(run_dir, "snapshots", "2.json"))
    with pytest.raises(NoIntactSnapshotError, match="no older snapshot") as info:
        SnapshotStore(run_dir).load_latest()
    assert isinstance(info.value, SnapshotError) and isinstance(info.value, ValueError)  # exit 2
    assert _notices(run_dir, "fatal")


def test_the_fallback_works_on_gcs(gcs_bucket):
    run_dir = storage.join(gcs_bucket, "run")
    store = SnapshotStore(run_dir)
    for step in (2, 4):
        store.write(snap(step, groups=2))
    _truncate(storage.join(run_dir, "snapshots", "4.buffer.parquet"))
    assert SnapshotStore(run_dir).load_latest() == snap(2, groups=2)
    names = _snapshots(run_dir)
    assert "4.json" not in names and "4.buffer.parquet" not in names
    assert any(n.startswith("4.json.damaged-") for n in names)
    assert any(n.startswith("4.buffer.parquet.damaged-") for n in names)
    assert SnapshotStore(run_dir).load_latest() == snap(2, groups=2)  # committed: no new notice
    assert len(_notices(run_dir, "fallback")) == 1


def test_a_null_or_non_finite_reward_scores_zero_instead_of_crashing():
    assert reward_and_verdict(None) == (0.0, "verifier_error")
    assert reward_and_verdict(float("nan")) == (0.0, "verifier_error")
    assert reward_and_verdict(SampleScore(None, "correct")) == (0.0, "verifier_error")
    assert reward_and_verdict(SampleScore(1.0, "correct")) == (1.0, "correct")
    assert reward_and_verdict(0.5) == (0.5, "")
