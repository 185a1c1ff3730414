"""Rollout buffer: the k rule, freshest first, drops counted; dynamic sampling; reload rule."""

from __future__ import annotations

import numpy as np
import pytest

from rlax_tasks.controller import RolloutBuffer, ScoredGroup
from rlax_tasks.rollout.staleness import should_reload, within_staleness


def group(pid: str, version: int, seq: int, scores=(0.0, 1.0)) -> ScoredGroup:
    g = len(scores)
    return ScoredGroup(
        pid,
        seq,
        version,
        (1, 5),
        tuple((7, 8)[: 1 + i % 2] for i in range(g)),
        tuple((-0.5, -0.25)[: 1 + i % 2] for i in range(g)),
        ("eos",) * g,
        tuple(scores),
        tuple(scores),
    )


@pytest.mark.parametrize(
    ("held", "latest", "j", "expected"),
    [
        (None, None, 1, False),
        (None, 0, 4, True),
        (3, 3, 1, False),
        (3, 4, 1, True),
        (0, 15, 16, False),
        (0, 16, 16, True),
        (5, 3, 2, False),
    ],
)
def test_should_reload(held, latest, j, expected):
    assert should_reload(held, latest, j) is expected


def test_within_staleness():
    assert within_staleness(3, 5, 2) and not within_staleness(2, 5, 2)
    assert within_staleness(0, 10_000, None)
    with pytest.raises(ValueError, match="earlier version"):
        within_staleness(5, 5, 2)


def test_k_rule_freshest_first_and_stale_drops_counted():
    buf = RolloutBuffer(prompts_per_step=2, max_staleness=2)
    for pid, v, seq in [
        ("old", 1, 0),
        ("mid", 3, 1),
        ("new-b", 4, 3),
        ("new-a", 4, 2),
        ("m2", 3, 4),
    ]:
        buf.add(group(pid, v, seq))
    batch = buf.take(5)  # producing v5: u must be >= 3; "old" (u=1) is dropped
    assert batch.prompt_ids == ["new-a", "new-b"]  # freshest, then in draw order
    assert [(d.prompt_id, d.reason) for d in batch.dropped] == [("old", "stale")]
    assert buf.counts == {"stale": 1, "zero_variance": 0, "skipped_prompts": 0}
    assert buf.prompt_ids == ["mid", "m2"]
    batch = buf.take(6)  # u >= 4 needed: both v3 groups are too old now
    assert batch is None and buf.counts["stale"] == 3 and len(buf) == 0
    buf.add(group("x", 5, 9))
    buf.add(group("y", 5, 8))
    batch = buf.take(6)
    assert batch.prompt_ids == ["y", "x"]
    assert [d.prompt_id for d in batch.dropped] == ["mid", "m2"]  # reported with the next batch


def test_a_batch_waits_for_an_earlier_draw_still_on_its_way():
    """Which prompts train depends on the draws, not on which worker answered first."""
    buf = RolloutBuffer(prompts_per_step=2, max_staleness=1)
    buf.add(group("a", 0, 0))
    buf.add(group("c", 0, 2))  # "b" (seq 1) is still generating on a slower worker
    assert buf.take(1, pending_seqs=[1, 3]) is None and len(buf) == 2
    buf.add(group("b", 0, 1))
    assert buf.take(1, pending_seqs=[3]).prompt_ids == ["a", "b"]
    assert buf.prompt_ids == ["c"]  # later draws pending do not hold a batch back
    buf.add(group("d", 0, 4))
    assert buf.take(1, pending_seqs=[3]) is None  # "d" would skip the pending seq 3


def test_not_enough_groups_takes_nothing_and_unbounded_k_keeps_all():
    buf = RolloutBuffer(prompts_per_step=3, max_staleness=None)
    buf.add(group("a", 0, 0))
    buf.add(group("b", 1, 1))
    assert buf.take(100) is None and len(buf) == 2
    buf.add(group("c", 2, 2))
    assert buf.take(100).prompt_ids == ["a", "b", "c"]


def test_dynamic_sampling_drops_zero_variance_groups():
    buf = RolloutBuffer(prompts_per_step=1, max_staleness=1, dynamic_sampling=True)
    assert not buf.add(group("zeros", 0, 0, scores=(0.0, 0.0, 0.0)))
    assert not buf.add(group("ones", 0, 1, scores=(1.0, 1.0)))
    assert buf.add(group("mixed", 0, 2, scores=(1.0, 0.0)))
    assert buf.counts["zero_variance"] == 2
    batch = buf.take(1)
    assert batch.prompt_ids == ["mixed"]
    assert [(d.prompt_id, d.reason) for d in batch.dropped] == [
        ("zeros", "zero_variance"),
        ("ones", "zero_variance"),
    ]
    off = RolloutBuffer(prompts_per_step=1, max_staleness=1, dynamic_sampling=False)
    assert off.add(group("zeros", 0, 0, scores=(0.0, 0.0)))


def test_state_round_trip_and_batch_arrays():
    buf = RolloutBuffer(prompts_per_step=2, max_staleness=2, dynamic_sampling=True)
    buf.add(group("a", 1, 0))
    buf.add(group("z", 1, 1, scores=(0.0, 0.0)))
    other = RolloutBuffer(prompts_per_step=2, max_staleness=2, dynamic_sampling=True)
    other.load_state_dict(buf.state_dict())
    assert other.groups == buf.groups and other.counts == buf.counts
    other.add(group("b", 2, 2, scores=(1.0, 0.0)))
    batch = other.take(3)
    arr = batch.arrays(pad_id=0)
    assert arr["input_ids"].shape == (4, 4)
    np.testing.assert_array_equal(arr["input_ids"][1], [1, 5, 7, 8])
    np.testing.assert_array_equal(arr["mask"][0], [0, 0, 1, 0])
    np.testing.assert_allclose(arr["behavior_logprobs"][1], [0, 0, -0.5, -0.25])
    np.testing.assert_array_equal(arr["group_ids"], [0, 0, 1, 1])
    np.testing.assert_array_equal(arr["rewards"], [0, 1, 1, 0])
    assert [d.prompt_id for d in batch.dropped] == ["z"]
