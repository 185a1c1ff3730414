"""Verifier verdicts: a Scorer may return SampleScores; their verdicts reach rollouts/, the
batch's stats (verifier failures) and snapshots. Bare rewards still work."""

from __future__ import annotations

import numpy as np
import pandas as pd

from rlax_tasks.controller import SnapshotStore, read_lineage, read_rollouts
from rlax_tasks.controller.buffer import VERIFIER_FAILURES
from rlax_tasks.controller.rollouts import read_step_batch
from tests.controller.fakes import FakeScorer, World, controller

STEPS = 6


def run(run_dir: str, scorer) -> tuple:
    world = World(scorer=scorer)
    c = controller(run_dir, world)
    c.start()
    c.run(STEPS, max_iterations=500)
    return c, world


def test_verdicts_reach_rollouts_stats_and_snapshots(tmp_path):
    run_dir = str(tmp_path / "run")
    c, world = run(run_dir, FakeScorer(verdicts=True))
    rows = read_rollouts(run_dir)
    assert set(rows["verdict"]) == {"correct", "wrong_answer", "verifier_error"}
    assert (rows.loc[rows["verdict"] == "verifier_error", "score"] == 0.0).all()
    assert (rows.loc[rows["verdict"] == "correct", "score"] == 1.0).all()
    errors = []
    for step, (batch, (_, got)) in enumerate(
        zip(world.trainer.batches, rows.groupby("step"), strict=True), start=1
    ):
        assert list(got["verdict"]) == [v for g in batch.groups for v in g.verdicts]
        n = int(got["verdict"].isin(VERIFIER_FAILURES).sum())
        assert batch.stats()["verifier_errors"] == n
        errors.append(n)
        # a replayed step (trainer restored from an older checkpoint) keeps its verdicts
        again = read_step_batch(run_dir, step)
        assert [g.verdicts for g in again.groups] == [g.verdicts for g in batch.groups]
        assert again.stats()["verifier_errors"] == n
    assert sum(errors) > 0
    # groups waiting in the buffer keep theirs through a snapshot (STEPS is a reload boundary)
    snap = SnapshotStore(run_dir).load_latest()
    assert snap.step == STEPS and snap.buffer["groups"]
    assert [g["verdicts"] for g in snap.buffer["groups"]] == [
        list(g.verdicts) for g in c.buffer.groups
    ]
    assert all(len(g["verdicts"]) == 4 for g in snap.buffer["groups"])


def test_bare_rewards_have_no_verdict(tmp_path):
    run_dir = str(tmp_path / "run")
    _, world = run(run_dir, FakeScorer())
    rows = read_rollouts(run_dir)
    assert len(rows) == STEPS * 4 * 4 and rows["verdict"].isna().all()
    assert all(g.verdicts == () for b in world.trainer.batches for g in b.groups)
    assert [b.stats()["verifier_errors"] for b in world.trainer.batches] == [0.0] * STEPS
    assert all(read_step_batch(run_dir, 1).groups[i].verdicts == () for i in range(4))


class NumpyScorer(FakeScorer):
    """Rewards as numpy scalars, as a scorer computing them with numpy returns them."""

    def score(self, prompts, results):
        kinds = (np.float32, np.int64, np.float64)
        return [
            [kinds[i % 3](x) for i, x in enumerate(row)] for row in super().score(prompts, results)
        ]


def test_numpy_rewards_are_rewards(tmp_path):
    ref, numpy_run = str(tmp_path / "ref"), str(tmp_path / "numpy")
    run(ref, FakeScorer())
    run(numpy_run, NumpyScorer())
    assert read_lineage(numpy_run) == read_lineage(ref)
    pd.testing.assert_frame_equal(read_rollouts(numpy_run), read_rollouts(ref))
