"""Dynamic sampling (filter_groups), DAPO overlong reward shaping and GAE."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tasks.algorithms import filter_groups, make_objective, overlong_penalty
from rlax_tasks.algorithms.gae import gae


def test_filter_groups_drops_and_counts_zero_variance_groups():
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.5, 0.5, 2.0, 0.0, 1.0])
    group_ids = np.array([3, 1, 3, 1, 8, 8, 5, 6, 6])
    keep, dropped = filter_groups(rewards, group_ids)
    # 3: all 1.0 (dropped); 1: mixed (kept); 8: all 0.5 (dropped); 5: singleton (dropped); 6 kept
    assert keep.tolist() == [False, True, False, True, False, False, False, True, True]
    assert dropped == 3
    assert keep.dtype == bool


def test_filter_groups_edge_cases():
    keep, dropped = filter_groups(np.zeros(4), np.zeros(4, int))
    assert keep.tolist() == [False] * 4 and dropped == 1
    keep, dropped = filter_groups(np.array([0.0, 1.0]), np.array([7, 7]))
    assert keep.tolist() == [True, True] and dropped == 0
    keep, dropped = filter_groups(np.zeros(0), np.zeros(0, int))
    assert keep.shape == (0,) and dropped == 0
    with pytest.raises(ValueError, match="same length"):
        filter_groups(np.zeros(3), np.zeros(2, int))
    with pytest.raises(ValueError, match="NaN"):
        filter_groups(np.array([np.nan, 1.0]), np.array([0, 0]))


def test_dropped_groups_are_exactly_the_zero_advantage_groups():
    rng = np.random.default_rng(0)
    rewards = rng.integers(0, 2, 32).astype(np.float32)
    group_ids = np.repeat(np.arange(8), 4)
    keep, _ = filter_groups(rewards, group_ids)
    batch = {"mask": np.ones((32, 3), np.float32), "rewards": rewards, "group_ids": group_ids}
    adv = np.asarray(make_objective("dapo").advantages(batch))[:, 0]
    assert np.all((adv != 0) == keep)


def test_overlong_penalty_values():
    lengths = np.array([0, 10, 16, 17, 18, 19, 20, 21, 100])
    expected = np.array([0, 0, 0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 4), expected)
    np.testing.assert_allclose(overlong_penalty(lengths, 20, 4, factor=0.5), 0.5 * expected)
    # no soft zone: only lengths past max_len are punished
    np.testing.assert_allclose(overlong_penalty(np.array([19, 20, 21]), 20, 0), [0.0, 0.0, -1.0])
    # the whole budget is the soft zone
    np.testing.assert_allclose(overlong_penalty(np.array([0, 5, 10]), 10, 10), [0.0, -0.5, -1.0])


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_len": 0, "cache_len": 0}, "max_len"),
        ({"max_len": 10, "cache_len": 11}, "cache_len"),
        ({"max_len": 10, "cache_len": -1}, "cache_len"),
        ({"max_len": 10, "cache_len": 2, "factor": -1.0}, "factor"),
    ],
)
def test_overlong_penalty_rejects_bad_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        overlong_penalty(np.array([1, 2]), **kwargs)


def test_gae_hand_computed():
    """γ=0.9, λ=0.8, completion tokens at t=1..3, reward 1 at the last one, terminal after it.

    δ3 = 1 − 0.2 = 0.8               A3 = 0.8
    δ2 = 0.9·0.2 − 0.4 = −0.22       A2 = −0.22 + 0.72·0.8 = 0.356
    δ1 = 0.9·0.4 − 0.5 = −0.14       A1 = −0.14 + 0.72·0.356 = 0.11632
    """
    values = jnp.array([[9.0, 0.5, 0.4, 0.2, 9.0]])
    mask = jnp.array([[0.0, 1.0, 1.0, 1.0, 0.0]])
    adv, ret = gae(jnp.array([1.0]), values, mask, gamma=0.9, lam=0.8)
    np.testing.assert_allclose(adv, [[0.0, 0.11632, 0.356, 0.8, 0.0]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[0.0, 0.61632, 0.756, 1.0, 0.0]], rtol=1e-6)
    # the same through the ppo objective, unwhitened
    obj = make_objective("ppo", gamma=0.9, gae_lambda=0.8, whiten_advantages=False)
    batch = {
        "mask": mask,
        "rewards": jnp.array([1.0]),
        "group_ids": jnp.array([0]),
        "values": values,
    }
    np.testing.assert_allclose(obj.advantages(batch), adv, rtol=1e-6)


def test_gae_bridges_masked_gaps_and_whitens():
    # tokens at t=0 and t=2 (t=1 masked): λ=γ=1 → every advantage is R − V_t
    values = jnp.array([[0.25, 7.0, 0.5]])
    mask = jnp.array([[1.0, 0.0, 1.0]])
    adv, _ = gae(jnp.array([2.0]), values, mask, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(adv, [[1.75, 0.0, 1.5]], rtol=1e-6)
    obj = make_objective("ppo")
    batch = {
        "mask": jnp.ones((2, 4)),
        "rewards": jnp.array([1.0, 0.0]),
        "group_ids": jnp.array([0, 1]),
        "values": jnp.linspace(0.0, 1.0, 8).reshape(2, 4),
    }
    white = np.asarray(obj.advantages(batch))
    np.testing.assert_allclose(white.mean(), 0.0, atol=1e-6)
    np.testing.assert_allclose(white.std(ddof=1), 1.0, rtol=1e-4)
