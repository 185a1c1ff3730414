"""Prompts the run cannot use (docs/design.md §11): too long for the workers, not encodable, or
refused by a worker as invalid are skipped, counted and listed in lineage; they never end the run,
unless every prompt drawn is unusable (a configuration problem)."""

from __future__ import annotations

import pytest

from rlax_tasks.controller import RolloutBuffer, SnapshotStore, read_lineage
from rlax_tasks.controller.rollouts import read_step_batch
from tests.controller.fakes import UNENCODABLE, World, controller, encode, mixture
from tests.controller.test_buffer import group

LIMIT = 40  # max_prompt_tokens: "a prompt 12" is 12 tokens with the fake encoder
LONG = [{"role": "user", "content": "x" * 200}]  # chat messages, 201 tokens
CONTENTS = {"b": {3: LONG, 5: f"b prompt 5 {UNENCODABLE}"}}
TOO_LONG = f"prompt has 201 tokens, more than the {LIMIT} a worker takes"
NOT_ENCODABLE = "cannot be encoded: the chat template cannot render this prompt"


def unusable_mixture():
    return mixture(seed=3, contents=CONTENTS)


def run_counting_skips(c, steps: int) -> list[int]:
    """Runs to ``steps``; for each skip, the training step that follows it (a skip while the
    next prompts are drawn right after a step is listed by the step after that one)."""
    expected: list[int] = []
    skip = c.buffer.skip

    def recording_skip(*args, **kwargs):
        expected.append(c.step + 1)
        return skip(*args, **kwargs)

    c.buffer.skip = recording_skip
    for _ in range(500):
        if c.step >= steps:
            return expected
        c.iterate(last_step=steps)
    raise AssertionError(f"no step {steps} after 500 iterations")


def test_too_long_and_unencodable_prompts_are_skipped_listed_and_counted(tmp_path):
    run_dir = str(tmp_path / "run")
    world = World()
    c = controller(run_dir, world, unusable_mixture(), max_prompt_tokens=LIMIT)
    c.start()
    expected_steps = run_counting_skips(c, 8)
    lineage = read_lineage(run_dir)
    assert [r["step"] for r in lineage] == list(range(1, 9))  # the run reaches its steps
    skipped = [
        (r["step"], s["prompt_id"], s["reason"]) for r in lineage for s in r["skipped_prompts"]
    ]
    reasons = {pid.rsplit("/", 1)[1]: reason for _, pid, reason in skipped}
    assert reasons["3"].startswith(TOO_LONG) and reasons["5"] == NOT_ENCODABLE
    assert all(pid.startswith("b/") and pid[-2:] in ("/3", "/5") for _, pid, _ in skipped)
    assert len(skipped) > 2  # more than one epoch of b: each is skipped every time drawn
    # listed once, by the training step right after it was drawn
    assert [step for step, _, _ in skipped] == expected_steps
    submitted = {pid for _, pids in world.pool.submits for pid in pids}
    assert not submitted & {pid for _, pid, _ in skipped}
    assert len(submitted) > 8 * 4  # the other prompts went through
    assert c.status()["skipped_prompts"] == len(skipped) == c.buffer.counts["skipped_prompts"]
    by_step = [len(r["skipped_prompts"]) for r in lineage]
    assert [b.stats()["prompts_skipped"] for b in world.trainer.batches] == by_step
    assert [[s.prompt_id for s in b.skipped] for b in world.trainer.batches] == [
        [s["prompt_id"] for s in r["skipped_prompts"]] for r in lineage
    ]


@pytest.mark.parametrize(("prompts_per_step", "threshold"), [(4, 64), (20, 80)])
def test_a_mixture_of_only_too_long_prompts_is_a_clear_error(tmp_path, prompts_per_step, threshold):
    encoded = []

    def encode_a_bounded_number(content):  # a controller that draws forever fails the test
        encoded.append(content)
        assert len(encoded) <= 10 * threshold, "still drawing: no error after 10x the threshold"
        return encode(content)

    world = World()
    c = controller(
        str(tmp_path / "run"),
        world,
        prompts_per_step=prompts_per_step,
        max_prompt_tokens=3,
        encode=encode_a_bounded_number,
    )
    c.start()
    with pytest.raises(ValueError, match=f"the last {threshold} prompts drawn were all skipped"):
        c.run(5, max_iterations=50)
    assert c.counters["skipped_prompts"] == threshold == c.mixture.draws == len(encoded)
    assert world.pool.submits == []


def test_a_mixture_unusable_from_the_second_step_on_fails_after_the_first_is_recorded(tmp_path):
    """The next step's prompts are drawn as soon as a step is trained: when none of them is
    usable, the error comes once that step's lineage, rollouts and snapshot are written."""
    run_dir = str(tmp_path / "run")
    world = World()

    def too_long_once_trained(content):  # 200 tokens from the second step's prompts on
        return [7] * 200 if world.trainer.batches else encode(content)

    c = controller(
        run_dir,
        world,
        max_prompt_tokens=LIMIT,
        reload_every=1,
        max_staleness=1,
        max_outstanding_groups=4,
        encode=too_long_once_trained,
    )
    c.start()
    with pytest.raises(ValueError, match="prompts drawn were all skipped"):
        for _ in range(50):
            c.iterate(last_step=3)
    assert c.step == 1 and len(world.trainer.batches) == 1
    assert [r["step"] for r in read_lineage(run_dir)] == [1]
    assert read_step_batch(run_dir, 1).prompt_ids == world.trainer.batches[0].prompt_ids
    snap = SnapshotStore(run_dir).load_latest()
    assert snap.step == 1 and snap.pending is None


def test_many_too_long_prompts_but_never_a_threshold_in_a_row_do_not_end_the_run(tmp_path):
    long_ones = {i: f"long prompt {i} " + "y" * 60 for i in range(50)}
    mix = mixture(
        seed=3, sizes={"long": (50, 3.0), "short": (50, 1.0)}, contents={"long": long_ones}
    )
    c = controller(str(tmp_path / "run"), World(), mix, max_prompt_tokens=LIMIT)
    c.start()
    c.run(30, max_iterations=2000)
    assert c.counters["skipped_prompts"] > 2 * 64  # far more than the threshold, spread out
    lineage = read_lineage(str(tmp_path / "run"))
    skipped = [s["prompt_id"] for r in lineage for s in r["skipped_prompts"]]
    assert len(skipped) == c.counters["skipped_prompts"]
    assert all(pid.startswith("long/") for pid in skipped)


def test_a_worker_rejecting_one_group_of_several_skips_that_prompt_alone(tmp_path):
    """HTTP 400 for a submit of 4 groups: they are sent again one by one; the one the worker
    refuses alone is skipped with its reason, the others train."""
    run_dir = str(tmp_path / "run")
    world = World(reload_every=1)
    c = controller(
        run_dir, world, prompts_per_step=8, max_outstanding_groups=8, groups_per_worker=4,
        reload_every=1, max_staleness=1, dynamic_sampling=False,
    )  # fmt: skip
    ids = [p.id for p in mixture(seed=3).take(9)]
    reason = "prompt of 900 tokens does not fit max_len 512"
    world.pool.invalid[ids[4]] = reason  # the third group for w0 (w0 gets draws 0, 2, 4, 6)
    c.start()
    c.iterate()
    assert world.pool.rejected == [("w0", [ids[0], ids[2], ids[4], ids[6]]), ("w0", [ids[4]])]
    assert world.pool.submits == [
        ("w0", [ids[0]]),
        ("w0", [ids[2]]),
        ("w0", [ids[6]]),
        ("w1", [ids[1], ids[3], ids[5], ids[7]]),
    ]
    assert c.counters["worker_failures"] == 0 and world.pool.resets == ["w0", "w1"]  # start()
    c.run(3, max_iterations=500)
    lineage = read_lineage(run_dir)
    assert lineage[0]["skipped_prompts"] == [
        {"prompt_id": ids[4], "reason": f"worker w0 rejected it: {reason}"}
    ]
    assert lineage[0]["prompt_ids"] == ids[:4] + ids[5:9]  # its neighbours train
    assert all(not r["skipped_prompts"] for r in lineage[1:])
    assert ids[4] not in [p for r in lineage for p in r["prompt_ids"]]
    assert c.status()["skipped_prompts"] == 1
    assert world.trainer.batches[0].stats()["prompts_skipped"] == 1.0


def test_skipped_prompts_survive_a_crash_before_the_step_that_lists_them(tmp_path):
    """The write-ahead snapshot holds the prompts skipped since the last step; the restored
    controller replays that step and its lineage record lists them, as uninterrupted."""
    ref_dir, run_dir = str(tmp_path / "ref"), str(tmp_path / "run")
    ref = controller(ref_dir, World(), unusable_mixture(), max_prompt_tokens=LIMIT)
    ref.start()
    ref.run(10, max_iterations=500)

    world = World()
    first = controller(run_dir, world, unusable_mixture(), max_prompt_tokens=LIMIT)
    first.start()
    with pytest.raises(KeyboardInterrupt):
        for _ in range(500):
            if first.step >= 3 and first.buffer.state_dict()["skipped"]:
                world.trainer.crash_after_next = True  # the next step dies after applying
            first.iterate()
    crashed = first.step + 1
    snap = SnapshotStore(run_dir).load_latest()
    assert snap.pending is not None and snap.buffer["skipped"]
    assert len(read_lineage(run_dir)) == first.step

    second = controller(run_dir, world, unusable_mixture(), max_prompt_tokens=LIMIT)
    assert second.start() is True and world.trainer.replays == 1
    second.run(10, max_iterations=500)
    lineage = read_lineage(run_dir)
    assert [s["prompt_id"] for s in lineage[crashed - 1]["skipped_prompts"]] == [
        s["prompt_id"] for s in snap.buffer["skipped"]
    ]
    assert lineage == read_lineage(ref_dir)


def test_buffer_state_round_trips_skipped_prompts_and_loads_older_state():
    buf = RolloutBuffer(prompts_per_step=1, max_staleness=1)
    buf.skip("long/0/1", "prompt has 900 tokens")
    buf.add(group("a", 0, 0))
    other = RolloutBuffer(prompts_per_step=1, max_staleness=1)
    other.load_state_dict(buf.state_dict())
    assert other.counts["skipped_prompts"] == 1
    batch = other.take(1)
    assert [(s.prompt_id, s.reason) for s in batch.skipped] == [
        ("long/0/1", "prompt has 900 tokens")
    ]
    assert other.take(1) is None and other.state_dict()["skipped"] == []  # listed once
    # a snapshot written before prompts could be skipped: no "skipped", older counts
    old = {"groups": [group("a", 0, 0).to_dict()], "dropped": [], "counts": {"stale": 2}}
    del old["groups"][0]["verdicts"]
    legacy = RolloutBuffer(prompts_per_step=1, max_staleness=1)
    legacy.load_state_dict(old)
    assert legacy.counts == {"stale": 2, "zero_variance": 0, "skipped_prompts": 0}
    batch = legacy.take(1)
    assert batch.prompt_ids == ["a"] and batch.skipped == () and batch.groups[0].verdicts == ()
