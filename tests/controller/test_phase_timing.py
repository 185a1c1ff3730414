"""Per-phase wall-clock accounting of the controller loop, on a fake clock (no sleeps).

Each batch sent to the trainer carries the seconds per phase of the cycle that ended when it
was sent (``time_<phase>_s``, ``time_other_s``, ``time_cycle_s``) in ``Batch.stats()``: the
train, lineage and rollouts times in it are the previous step's.
"""

from __future__ import annotations

from rlax_tasks.controller.phases import PHASES
from tests.controller.fakes import FakeScorer, World, controller

STEPS = 5
TRAIN_S = 7.0  # the slow fake trainer's seconds per step
SCORE_S = 0.5  # the slow fake scorer's seconds per call
IDLE_S = 0.25  # the driver's "sleep" between two iterations
KEYS = {f"time_{p}_s" for p in PHASES} | {"time_other_s", "time_cycle_s"}


class SlowScorer(FakeScorer):
    """The fake scorer, taking SCORE_S of the fake clock per call."""

    def __init__(self, now: list[float]) -> None:
        super().__init__()
        self.now = now

    def score(self, prompts, results):
        self.now[0] += SCORE_S
        return super().score(prompts, results)


def slow_world(now: list[float]) -> World:
    """The fakes, with a trainer that takes TRAIN_S and a scorer SCORE_S of the fake clock."""
    world = World(scorer=SlowScorer(now))
    train = world.trainer.__call__

    def slow_train(batch) -> int:
        now[0] += TRAIN_S
        return train(batch)

    world.train_step = slow_train
    return world


def drive(tmp_path, steps: int = STEPS):
    now = [0.0]
    world = slow_world(now)
    c = controller(str(tmp_path / "run"), world, clock=lambda: now[0])
    c.train_step = world.train_step
    c.start()
    for _ in range(500):  # the driver's loop: it sleeps between iterations
        if c.step >= steps:
            break
        c.iterate()
        now[0] += IDLE_S
    assert c.step == steps
    return c, world, [b.stats() for b in world.trainer.batches]


def test_every_step_carries_non_negative_phase_times(tmp_path):
    c, world, stats = drive(tmp_path)
    assert len(stats) == STEPS
    for row in stats:
        assert KEYS <= set(row), KEYS - set(row)
        assert all(row[k] >= 0.0 for k in KEYS), row
        # the phases and the rest add up to the cycle (the time between two steps)
        parts = sum(row[f"time_{p}_s"] for p in PHASES) + row["time_other_s"]
        assert abs(parts - row["time_cycle_s"]) < 1e-9, row
    # the counts are still there beside the times
    assert all("prompts_skipped" in row and "verifier_errors" in row for row in stats)
    # this process's totals: every step's train call, the last one's too
    assert c.phases.totals["train"] == STEPS * TRAIN_S


def test_a_slow_trainer_shows_in_the_train_phase_of_the_next_step(tmp_path):
    _, _, stats = drive(tmp_path)
    # the first step's own train time is not known when it is sent
    assert stats[0]["time_train_s"] == 0.0
    assert [row["time_train_s"] for row in stats[1:]] == [TRAIN_S] * (STEPS - 1)
    # the fake clock moves only in the trainer, the scorer and the driver's sleeps
    for row in stats:
        assert row["time_score_s"] > 0 and row["time_score_s"] % SCORE_S == 0
        assert row["time_wait_s"] % IDLE_S == 0  # the driver's sleeps
        assert row["time_other_s"] == 0.0
        for p in ("dispatch", "collect", "batch", "snapshot", "lineage", "rollouts"):
            assert row[f"time_{p}_s"] == 0.0, (p, row)
        assert row["time_cycle_s"] == (
            row["time_train_s"] + row["time_score_s"] + row["time_wait_s"]
        )
    # after a step, at least one sleep of the driver before the next
    assert all(row["time_wait_s"] >= IDLE_S for row in stats[1:])


def test_timings_do_not_change_what_trains(tmp_path):
    """The timings are metrics only: a batch compares equal to one without them."""
    import dataclasses

    _, world, _ = drive(tmp_path, steps=2)
    batch = world.trainer.batches[0]
    assert batch.timings and dataclasses.replace(batch, timings={}) == batch
    assert set(dataclasses.replace(batch, timings={}).stats()) == {
        "prompts_skipped",
        "verifier_errors",
    }
