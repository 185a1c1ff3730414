"""Scoring on threads beside the controller's (``scoring_threads``): the controller keeps
collecting while a job runs, batches are those of inline scoring, a snapshot re-queues the groups
being scored, and a failing scorer is retried."""

from __future__ import annotations

import threading
import time

import numpy as np
import pandas as pd

from rlax_tasks.controller import SnapshotStore, read_lineage, read_rollouts
from tests.compute.helpers import wait_for
from tests.controller.fakes import FakeScorer, World, controller

STEPS = 8


def trained_or_dropped(run_dir: str) -> set[str]:
    lineage = read_lineage(run_dir)
    ids = {p for r in lineage for p in r["prompt_ids"]}
    kinds = ("dropped_stale", "dropped_zero_variance")
    return ids | {d["prompt_id"] for r in lineage for k in kinds for d in r[k]}


def run_to(c, steps: int) -> int:
    """Runs ``c`` to ``steps``; returns in how many rounds groups were left being scored."""
    busy = 0
    for _ in range(100_000):
        if c.step >= steps:
            return busy
        if not c.iterate():
            time.sleep(0.0005)
        busy += c.status()["scoring"] > 0
    raise AssertionError(f"no step {steps} after 100000 rounds")


def test_threaded_scoring_trains_the_same_batches_as_inline(tmp_path):
    """Rollout versions must not depend on timing for the comparison: the workers keep
    version 0 (k unbounded). Which prompts train then depends on the draws alone, provided
    groups being scored hold a batch back as groups being generated do: here a slow worker
    returns the earliest draws last, after every later group was scored."""
    dirs, worlds, busy = {}, {}, {}
    for threads in (0, 1):
        dirs[threads] = str(tmp_path / f"threads-{threads}")
        scorer = FakeScorer(delay_s=0.002 * threads)
        world = worlds[threads] = World(reload_every=10_000, rate=4, scorer=scorer)
        world.pool.hung.add("w1")  # then returns its 4 groups at once
        c = controller(dirs[threads], world, max_staleness=None, scoring_threads=threads)
        c.start()

        def settled(c=c, world=world) -> bool:  # w0 did all it could, every group is scored
            if not c.iterate():
                time.sleep(0.0005)
            done = c.outstanding == 24 and not world.pool.workers["w0"].queue
            return done and c.status()["scoring"] == 0

        wait_for(settled, timeout_s=30, every_s=0)
        assert c.step == 0 and len(c.buffer) > 4  # waiting for w1's earlier draws
        world.pool.hung.discard("w1")
        busy[threads] = run_to(c, STEPS)
        c.close()
    inline, threaded = worlds[0], worlds[1]
    assert set(inline.scorer.threads) == {threading.current_thread().name} and busy[0] == 0
    assert all(name.startswith("rlax-score") for name in threaded.scorer.threads)
    assert [b.prompt_ids for b in threaded.trainer.batches] == [
        b.prompt_ids for b in inline.trainer.batches
    ]
    for got, want in zip(threaded.trainer.batches, inline.trainer.batches, strict=True):
        for key, value in want.arrays().items():
            np.testing.assert_array_equal(got.arrays()[key], value, err_msg=key)
    pd.testing.assert_frame_equal(read_rollouts(dirs[1]), read_rollouts(dirs[0]))
    keys = ("step", "version", "prompt_ids", "rollout_versions")
    records = {t: [{k: r[k] for k in keys} for r in read_lineage(d)] for t, d in dirs.items()}
    assert records[1] == records[0]
    assert busy[1] > 0  # the controller went on while jobs ran
    # dynamic sampling dropped groups meanwhile (which step lists a drop depends on timing)
    assert sum(len(r["dropped_zero_variance"]) for r in read_lineage(dirs[0])) > 0


def blocked(run_dir: str, **overrides):
    """A controller whose scorer (on its thread) blocks in its first job until released."""
    gate = threading.Event()
    world = World(scorer=FakeScorer(gate=gate))
    c = controller(run_dir, world, scoring_threads=1, **overrides)
    c.start()
    c.iterate()  # dispatches, collects the first groups and hands them to the scoring thread
    wait_for(lambda: world.scorer.calls == 1, timeout_s=10, every_s=0.01)
    return c, world, gate


def test_the_controller_keeps_collecting_while_a_scoring_job_runs(tmp_path):
    run_dir = str(tmp_path / "run")
    c, world, gate = blocked(run_dir)
    try:
        first_job = list(world.scorer.scored[0])
        assert first_job and c.status()["scoring"] == len(first_job)
        for _ in range(4):
            c.iterate()  # returns while the scorer is blocked
        assert world.scorer.calls == 1  # one thread: the next job waits for it
        assert c.status()["scoring"] > len(first_job)  # more results were collected meanwhile
        assert c.step == 0 and len(c.buffer) == 0
        assert world.scorer.threads[0].startswith("rlax-score")
        assert world.scorer.threads[0] != threading.current_thread().name
    finally:
        gate.set()
    c.run(4, max_iterations=100_000)
    c.close()
    assert [r["step"] for r in read_lineage(run_dir)] == [1, 2, 3, 4]
    assert set(first_job) <= trained_or_dropped(run_dir)


def test_a_snapshot_during_a_scoring_job_requeues_its_groups_to_be_generated_again(tmp_path):
    run_dir = str(tmp_path / "run")
    c, world, gate = blocked(run_dir)
    try:
        c.iterate()  # more results: they wait for the scoring thread
        being_scored = list(world.scorer.scored[0])
        waiting = c.status()["scoring"] - len(being_scored)
        assert waiting > 0
        snap = c.snapshot()
    finally:
        gate.set()
        c.close()
    queued = [q["prompt_id"] for q in snap.queued]
    assert queued[: len(being_scored)] == being_scored  # first, in the order collected
    assert len(queued) == len(being_scored) + waiting
    assert not set(queued) & set(snap.in_flight_ids) and snap.buffer["groups"] == []
    assert SnapshotStore(run_dir).load_latest().queued == snap.queued

    world.scorer = FakeScorer()  # the restored controller scores inline
    restored = controller(run_dir, world)
    assert restored.start() is True
    assert restored.queued_ids == queued
    submitted = len(world.pool.submits)
    restored.run(4, max_iterations=500)
    regenerated = [pid for _, pids in world.pool.submits[submitted:] for pid in pids]
    assert set(queued) <= set(regenerated)
    assert set(queued) <= trained_or_dropped(run_dir)


def test_a_scorer_failure_on_the_scoring_thread_is_retried_and_counted(tmp_path):
    run_dir = str(tmp_path / "run")
    world = World()
    world.scorer.fail_next = 2
    c = controller(run_dir, world, scoring_threads=1, idle_sleep_s=0.0005)
    c.start()
    c.run(3, max_iterations=100_000)
    c.close()
    assert c.counters["scorer_failures"] == 2
    assert all(name.startswith("rlax-score") for name in world.scorer.threads)
    first = world.scorer.scored[0]
    assert world.scorer.scored[1][: len(first)] == first  # the same groups, scored again
    assert world.scorer.scored[2][: len(first)] == first
    assert [r["step"] for r in read_lineage(run_dir)] == [1, 2, 3]
    assert set(first) <= trained_or_dropped(run_dir)


def test_a_driver_waits_for_the_scoring_job_and_is_woken_when_it_ends(tmp_path):
    c = controller(str(tmp_path / "none"), World(), scoring_threads=1)
    c.start()
    t0 = time.monotonic()
    assert c.wait_for_scoring(5.0) is False  # no job: returns at once, no sleep
    assert time.monotonic() - t0 < 1.0
    c.close()

    c, world, gate = blocked(str(tmp_path / "run"))
    try:
        t0 = time.monotonic()
        assert c.wait_for_scoring(0.2) is True  # a job runs: waited, up to the timeout
        assert 0.19 <= time.monotonic() - t0 < 5.0
        threading.Timer(0.1, gate.set).start()
        t0 = time.monotonic()
        assert c.wait_for_scoring(30.0) is True
        assert time.monotonic() - t0 < 5.0  # woken when the job ended, not at the timeout
    finally:
        gate.set()
        c.close()
