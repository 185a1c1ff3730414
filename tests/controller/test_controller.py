"""The Controller with deterministic in-process fakes: decisions, failures, crash and restore."""

from __future__ import annotations

import copy
import dataclasses
import os

import numpy as np
import pytest

from rlax_tasks.controller import Controller, SnapshotStore, read_lineage
from rlax_tasks.rollout.requests import SamplingParams
from rlax_tasks.rundir import storage
from tests.controller.fakes import World, controller, mixture, trained

N = 12  # training steps of a full run (j = 2: snapshots at even steps)


def full_run(run_dir: str, steps: int = N) -> tuple[Controller, World]:
    world = World()
    c = controller(run_dir, world)
    assert c.start() is False
    c.run(steps, max_iterations=500)
    return c, world


def started_beside_a_reference(tmp_path) -> tuple[str, World, Controller]:  # noqa: ANN001
    """Runs the uninterrupted reference in tmp_path/ref; (run dir, world, started controller) of
    a second run in tmp_path/run, to compare with it."""
    full_run(str(tmp_path / "ref"))
    run_dir = str(tmp_path / "run")
    world = World()
    c = controller(run_dir, world)
    c.start()
    return run_dir, world, c


def test_uninterrupted_run_trains_drops_and_records(tmp_path):
    c, world = full_run(str(tmp_path / "a"))
    lineage = read_lineage(str(tmp_path / "a"))
    assert [r["step"] for r in lineage] == list(range(1, N + 1))
    assert [r["version"] for r in lineage] == list(range(1, N + 1))
    assert world.trainer.version == N and len(world.trainer.batches) == N
    consumed = [p for r in lineage for p in r["prompt_ids"]]
    assert len(consumed) == len(set(consumed)) == N * 4  # exactly prompts_per_step per step
    dropped = [
        d["prompt_id"] for r in lineage for d in r["dropped_stale"] + r["dropped_zero_variance"]
    ]
    assert not set(dropped) & set(consumed)
    # the staleness rule holds for every group that trained: v - u <= k (= 2)
    for r in lineage:
        assert all(0 < r["version"] - u <= 2 for u in r["rollout_versions"])
    # this configuration exercises both kinds of drops
    assert sum(len(r["dropped_stale"]) for r in lineage) > 0
    assert sum(len(r["dropped_zero_variance"]) for r in lineage) > 0
    assert c.status()["dropped_stale"] == sum(len(r["dropped_stale"]) for r in lineage)
    # snapshots at every reload boundary (j = 2), the newest committed one is step N
    snap = SnapshotStore(str(tmp_path / "a")).load_latest()
    assert snap.step == N and snap.version == N


def test_two_uninterrupted_runs_are_identical(tmp_path):
    full_run(str(tmp_path / "a"))
    full_run(str(tmp_path / "b"))
    assert read_lineage(str(tmp_path / "a")) == read_lineage(str(tmp_path / "b"))


def test_controller_crash_at_snapshot_then_restore_matches_uninterrupted(tmp_path):
    run_dir, world, first = started_beside_a_reference(tmp_path)
    first.run(N // 2, max_iterations=500)
    snap = SnapshotStore(run_dir).load_latest()
    assert snap.step == N // 2 and snap.in_flight and snap.buffer["groups"]
    # kill -9 of the controller: workers and trainer keep running; a new controller restores
    second = controller(run_dir, world)
    assert second.start() is True
    assert second.step == N // 2 and second.version == N // 2
    assert set(world.pool.resets) >= {"w0", "w1"}
    second.run(N, max_iterations=500)
    assert read_lineage(run_dir) == read_lineage(str(tmp_path / "ref"))


def test_crash_between_snapshot_write_and_pointer_commit(tmp_path, monkeypatch):
    """Steps after the committed snapshot are replayed; the uncommitted snapshot is never used;
    lineage ends up exactly as in an uninterrupted run (no step recorded twice)."""
    run_dir, world, first = started_beside_a_reference(tmp_path)
    first.run(N // 2, max_iterations=500)
    restored_world = copy.deepcopy(world)  # trainer checkpoint + PS + workers at step N/2

    def crash(*args, **kwargs):
        raise KeyboardInterrupt("killed between snapshot write and pointer commit")

    monkeypatch.setattr(storage, "commit_pointer", crash)
    with pytest.raises(KeyboardInterrupt):
        first.run(N // 2 + 2, max_iterations=500)
    monkeypatch.undo()
    names = storage.list_children(storage.join(run_dir, "snapshots"))
    # the write-ahead snapshot of step N/2 + 1 was written, its pointer never committed, and
    # so that step was never sent to the trainer
    assert f"{N // 2}.pending.json" in names
    assert len(read_lineage(run_dir)) == N // 2

    second = controller(run_dir, restored_world)
    assert second.start() is True
    assert second.step == N // 2  # the previous committed snapshot
    second.run(N, max_iterations=500)
    lineage = read_lineage(run_dir)
    assert [r["step"] for r in lineage] == list(range(1, N + 1))
    assert lineage == read_lineage(str(tmp_path / "ref"))
    # the restored trainer replayed exactly the batches of the uninterrupted run
    assert [b.prompt_ids for b in restored_world.trainer.batches[N // 2 :]] == [
        r["prompt_ids"] for r in lineage[N // 2 :]
    ]


def test_crash_after_the_trainer_applied_a_step_replays_it_without_applying_it_twice(tmp_path):
    """Write-ahead snapshot: the controller dies after the trainer applied step N/2 + 1 but
    before it heard back; the restored controller re-sends exactly that batch, the trainer
    answers it as a replay, and the run ends identical to an uninterrupted one."""
    run_dir, world, first = started_beside_a_reference(tmp_path)
    first.run(N // 2, max_iterations=500)
    world.trainer.crash_after_next = True
    with pytest.raises(KeyboardInterrupt):
        first.run(N, max_iterations=500)
    assert world.trainer.version == N // 2 + 1 and len(read_lineage(run_dir)) == N // 2

    second = controller(run_dir, world)  # the trainer kept its state (its checkpoint)
    assert second.start() is True
    assert second.step == N // 2 + 1 and world.trainer.replays == 1
    second.run(N, max_iterations=500)
    lineage = read_lineage(run_dir)
    assert lineage == read_lineage(str(tmp_path / "ref"))
    assert len(world.trainer.batches) == N  # every step applied exactly once
    assert [b.prompt_ids for b in world.trainer.batches] == [r["prompt_ids"] for r in lineage]


def test_failed_worker_prompts_go_back_to_the_queue_front_in_order(tmp_path):
    world = World()
    c = controller(str(tmp_path / "run"), world)
    c.start()
    c.iterate()
    c.iterate()
    world.pool.fail_next.add("w1")
    c.iterate()  # w1 fails during collection: its prompts are queued at the front
    lost = world.pool.lost
    assert lost, "w1 should have held work in flight"
    assert c.counters["worker_failures"] == 1 and c.counters["reissued"] == len(lost)
    assert world.pool.workers["w1"].queue == []  # reset
    before = len(world.pool.submits)
    for _ in range(3):
        c.iterate()  # re-dispatch (w1 is skipped while it backs off)
    resent = [pid for _, pids in world.pool.submits[before:] for pid in pids]
    assert resent[: len(lost)] == lost  # first, in their original order
    assert all(w == "w0" for w, _ in world.pool.submits[before:])
    c.run(6, max_iterations=500)
    consumed = [p for r in read_lineage(str(tmp_path / "run")) for p in r["prompt_ids"]]
    assert len(consumed) == len(set(consumed))


def test_two_failures_queue_their_prompts_in_draw_order(tmp_path):
    world = World()
    c = controller(str(tmp_path / "run"), world)
    c.start()
    c.iterate()
    world.pool.fail_next.update({"w0", "w1"})
    c.iterate()  # both fail in collection order w0, then w1
    lost = world.pool.lost_by_worker
    assert lost["w0"] and lost["w1"]
    draws = mixture(seed=3)
    draw_order = [draws.next().id for _ in range(64)]
    assert c.queued_ids == sorted(lost["w0"] + lost["w1"], key=draw_order.index)
    assert c.in_flight_ids == []


def test_refused_dispatch_does_not_draw_past_the_budget(tmp_path):
    """Prompts a worker refused are re-issued, not replaced: a lockstep controller never has
    more than prompts_per_step prompts out (more would be generated by a version too old)."""
    now = [0.0]
    world = World(reload_every=1)
    c = controller(
        str(tmp_path / "run"), world, clock=lambda: now[0], prompts_per_step=4,
        max_outstanding_groups=4, groups_per_worker=4, reload_every=1, max_staleness=1,
    )  # fmt: skip
    c.start()
    world.pool.refuse_next.update({"w0", "w1"})
    c.iterate()  # both refuse the first dispatch: the 4 prompts go back to the queue
    assert c.counters["drawn"] == 4 and len(c.queued_ids) == 4
    now[0] += 60.0  # the workers are back after their back-off
    c.iterate()
    assert c.counters["drawn"] == 4 and len(c.queued_ids) == 0
    issued = [pid for _, pids in world.pool.submits for pid in pids]
    assert len(issued) == len(set(issued)) == 4


def test_silent_worker_times_out_and_its_prompts_are_reissued(tmp_path):
    now = [0.0]

    def clock():
        now[0] += 1.0
        return now[0]

    world = World()
    world.pool.hung.add("w1")
    c = controller(str(tmp_path / "run"), world, clock=clock, worker_timeout_s=10.0)
    c.start()
    c.run(4, max_iterations=500)
    assert c.counters["worker_timeouts"] >= 1
    lineage = read_lineage(str(tmp_path / "run"))
    assert len(lineage) == 4


def test_scorer_failure_keeps_groups_and_retries(tmp_path):
    world = World()
    world.scorer.fail_next = 2
    c = controller(str(tmp_path / "run"), world)
    c.start()
    c.run(3, max_iterations=500)
    assert c.counters["scorer_failures"] == 2
    assert len(read_lineage(str(tmp_path / "run"))) == 3


def make_lockstep(run_dir: str, world: World) -> Controller:
    """On-policy j = k = 1, one batch of 4 groups outstanding, no dynamic sampling."""
    return controller(
        run_dir,
        world,
        reload_every=1,
        max_staleness=1,
        max_outstanding_groups=4,
        dynamic_sampling=False,
    )


def test_lockstep_on_policy_uses_only_fresh_rollouts(tmp_path):
    world = World(reload_every=1)
    c = make_lockstep(str(tmp_path / "run"), world)
    c.start()
    c.run(5, max_iterations=500)
    for r in read_lineage(str(tmp_path / "run")):
        assert r["rollout_versions"] == [r["version"] - 1] * 4


@pytest.mark.parametrize(("last_step", "next_out"), [(3, True), (1, False)])
def test_a_trained_step_hands_out_the_next_prompts_before_its_snapshot_but_not_the_last(
    tmp_path, last_step, next_out
):
    """Lockstep: the next step's prompts go to the workers as soon as a step is trained (they
    generate on the new version while its records are written), so its snapshot holds them in
    flight; after the run's last step none are drawn for a step that will not come."""
    run_dir = str(tmp_path / "run")
    world = World(reload_every=1)
    c = make_lockstep(run_dir, world)
    c.start()
    while c.step < 1:
        c.iterate(last_step=last_step)
    snap = SnapshotStore(run_dir).load_latest()
    assert snap.step == 1 and snap.pending is None
    assert [e["prompt_id"] for e in snap.in_flight] == c.in_flight_ids
    assert len(c.in_flight_ids) == (4 if next_out else 0)
    submitted = [pid for _, pids in world.pool.submits for pid in pids]
    assert len(submitted) == (8 if next_out else 4)  # step 1's prompts, then step 2's
    if next_out:  # they train step 2 on the version step 1 produced
        c.run(2, max_iterations=500)
        assert read_lineage(run_dir)[1]["rollout_versions"] == [1] * 4


def test_overlong_shaping_changes_rewards_not_scores(tmp_path):
    world = World()
    c = controller(
        str(tmp_path / "run"),
        world,
        overlong_cache_len=3,
        overlong_factor=1.0,
        dynamic_sampling=False,
    )
    c.start()
    c.run(2, max_iterations=500)
    groups = [g for b in world.trainer.batches for g in b.groups]
    shaped = 0
    for g in groups:
        for toks, s, r in zip(g.completions, g.scores, g.rewards, strict=True):
            penalty = 0.0 if len(toks) <= 3 else (3 - len(toks)) / 3
            assert r == pytest.approx(s + penalty)
            shaped += len(toks) > 3
    assert shaped > 0


def test_restore_rejects_a_parameter_server_ahead_of_the_snapshot(tmp_path):
    run_dir = str(tmp_path / "run")
    world = World()
    first = controller(run_dir, world)
    first.start()
    first.run(3, max_iterations=500)  # trainer at 3; the newest snapshot is step 3's pending one
    for w in world.pool.workers.values():
        w.held = 5  # a parameter server with versions no trainer of this run produced
    second = controller(run_dir, world)
    second.start()
    assert second.version == 3 and world.trainer.replays == 1
    with pytest.raises(RuntimeError, match="ahead of the controller's snapshot"):
        second.run(6, max_iterations=50)


def test_settings_from_run_config():
    from rlax_tasks.config import load_config
    from rlax_tasks.controller import ControllerSettings

    s = ControllerSettings.from_run_config(load_config("qwq-32b-code"))
    assert (s.reload_every, s.max_staleness, s.dynamic_sampling) == (16, 32, True)
    assert s.overlong_cache_len == round(0.2 * 16384)
    cfg = load_config("tiny-arith")
    t = ControllerSettings.from_run_config(cfg)
    assert t.group_size == cfg.rollout.group_size and not t.dynamic_sampling
    assert t.sampling.max_new_tokens == cfg.rollout.max_new_tokens
    # longer prompts are skipped (docs/design.md §11); a run scores beside the controller's thread
    assert t.max_prompt_tokens == cfg.workers.max_len - cfg.rollout.max_new_tokens
    assert t.scoring_threads == 1


def test_the_settings_defaults_are_the_run_configs():
    """Each default the settings share with the run config is the config's: a run config left
    at its defaults gives the same value (the config's schema is their one owner)."""
    from rlax_tasks.config import RunConfig, load_config
    from rlax_tasks.controller import ControllerSettings

    def default(f):
        if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return f.default

    defaulted = [f for f in dataclasses.fields(RunConfig) if default(f) is not dataclasses.MISSING]
    cfg = dataclasses.replace(load_config("tiny-arith"), **{f.name: default(f) for f in defaulted})
    from_config = ControllerSettings.from_run_config(cfg)
    blank = ControllerSettings(
        prompts_per_step=1, group_size=1, sampling=SamplingParams(), groups_per_worker=1
    )
    # the controller's own (no config field), or a sentinel the config resolves (0, None)
    own = {"worker_retry_s", "scoring_threads", "max_outstanding_groups", "max_prompt_tokens"}
    checked = {
        f.name
        for f in dataclasses.fields(ControllerSettings)
        if f.default is not dataclasses.MISSING and f.name not in own
    }
    assert checked == {"reload_every", "max_staleness", "dynamic_sampling", "overlong_cache_len",
                       "overlong_factor", "worker_timeout_s", "seed"}  # fmt: skip
    for name in sorted(checked):
        assert getattr(blank, name) == getattr(from_config, name), name


def test_a_worker_that_is_not_up_is_retried_soon_then_less_often(tmp_path):
    """Start-up and restarts take seconds: retries back off 0.25 s, 0.5 s, 1 s ... up to
    worker_retry_s, and a worker not up yet is not counted as failed; a worker that accepts work
    is retried quickly again after a later failure."""
    now = [0.0]
    world = World()
    world.pool.down.add("w1")
    c = controller(str(tmp_path / "run"), world, clock=lambda: now[0], worker_retry_s=2.0)
    c.start()
    tries = []
    tick = 1 / 64  # exact in binary, like the delays: no rounding at the boundaries
    for _ in range(640):  # 10 simulated seconds
        n = len(world.pool.refused)
        c.iterate()
        if len(world.pool.refused) > n:
            tries.append(now[0])
        now[0] += tick
    gaps = [round(b - a, 3) for a, b in zip(tries, tries[1:], strict=False)]
    assert gaps[:4] == [0.25, 0.5, 1.0, 2.0] and set(gaps[4:]) == {2.0}, gaps
    # it never took work: starting, not failed (nothing lost, nothing re-issued)
    assert c.counters["worker_failures"] == 0 and c.counters["reissued"] == 0
    world.pool.down.discard("w1")
    for _ in range(160):
        c.iterate()
        now[0] += tick
    assert any(w == "w1" for w, _ in world.pool.submits)  # back in use after at most 2 s
    world.pool.refuse_next.add("w1")  # a later failure starts the back-off from 0.25 s again
    refused = len(world.pool.refused)
    while len(world.pool.refused) == refused:
        c.iterate()
        now[0] += tick
    now[0] -= tick
    assert c.health.down_until("w1") - now[0] == pytest.approx(0.25)
    assert c.counters["worker_failures"] == 1  # it had taken work: now it failed


def test_rollouts_of_every_step_are_written_once_as_parquet(tmp_path):
    """rollouts/ (docs/design.md §7): one row per completion the trainer saw, also across a
    replay."""
    from rlax_tasks.controller import read_rollouts

    run_dir, world, first = started_beside_a_reference(tmp_path)
    world.trainer.crash_after_next = True  # step applied, answer lost: the step is replayed
    with pytest.raises(KeyboardInterrupt):
        first.run(N, max_iterations=500)
    second = controller(run_dir, world)
    second.start()
    second.run(N, max_iterations=500)
    rows = read_rollouts(run_dir)
    assert len(rows) == N * 4 * 4  # steps x groups x G, none twice
    assert rows.equals(read_rollouts(str(tmp_path / "ref")))
    for batch, (step, got) in zip(world.trainer.batches, rows.groupby("step"), strict=True):
        assert list(got["prompt_id"][::4]) == batch.prompt_ids
        assert list(got["weight_version"][::4]) == batch.rollout_versions
        assert [list(t) for t in got["tokens"]] == [
            list(c) for g in batch.groups for c in g.completions
        ]
        assert list(got["reward"]) == pytest.approx([r for g in batch.groups for r in g.rewards])
        assert list(got["score"]) == pytest.approx([s for g in batch.groups for s in g.scores])
        assert set(got["verifier"]) == {"task"} and step == batch.version
    assert read_rollouts(str(tmp_path / "none")).empty


def test_a_trainer_restored_from_an_older_checkpoint_gets_the_missing_steps_again(tmp_path):
    """trainer.checkpoint_every > 1: a restarted trainer is behind; the controller replays the
    steps since its checkpoint from rollouts/, exactly the batches it trained on before."""
    run_dir, world, c = started_beside_a_reference(tmp_path)
    c.run(7, max_iterations=500)
    first = list(world.trainer.batches)
    world.trainer.version = 4  # kill -9, restored from the checkpoint of step 4
    world.trainer.batches = world.trainer.batches[:4]
    c.run(N, max_iterations=500)
    assert c.counters["replayed_steps"] == 3
    replayed = world.trainer.batches[4:7]
    for got, want in zip(replayed, first[4:7], strict=True):
        assert got.version == want.version and got.prompt_ids == want.prompt_ids
        for key, value in want.arrays().items():  # bit for bit what it trained on
            np.testing.assert_array_equal(got.arrays()[key], value, err_msg=key)
    assert [b.version for b in world.trainer.batches] == list(range(1, N + 1))
    assert read_lineage(run_dir) == read_lineage(str(tmp_path / "ref"))  # nothing else changed


def test_replay_without_the_rollouts_file_is_a_clear_error(tmp_path):
    world = World()
    run_dir, c = trained(tmp_path, world, 3)
    os.remove(os.path.join(run_dir, "rollouts", "step-00000002.parquet"))
    world.trainer.version = 1
    with pytest.raises(FileNotFoundError, match="step 2 again"):
        c.run(4, max_iterations=500)


def test_a_malformed_answer_is_refused_and_nothing_else_is_affected(tmp_path):
    """A worker answering a group with the wrong number of completions is refused whole: its
    prompts go out again (to any worker), the other worker goes on, every step trains once."""
    world = World()
    original = world.pool.results
    broken = {"w0": 1}

    def results(worker_id):
        out = original(worker_id)
        if out and broken.get(worker_id):
            broken[worker_id] -= 1
            r = out[0]
            out[0] = dataclasses.replace(r, completions=r.completions[:-1])  # one short
        return out

    world.pool.results = results
    run_dir, c = trained(tmp_path, world, steps=4)
    assert c.counters["malformed_results"] == 1 and c.counters["worker_failures"] == 1
    assert world.pool.resets.count("w0") >= 2  # reset at start, then for its bad answer
    lineage = read_lineage(run_dir)
    assert [r["step"] for r in lineage] == [1, 2, 3, 4]
    ids = [p for r in lineage for p in r["prompt_ids"]]
    assert len(ids) == len(set(ids))  # no prompt trained twice
