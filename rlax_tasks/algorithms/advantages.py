"""Outcome advantages (Adv slot of docs/design.md §4): one value per sequence from rewards and
groups.

Groups are integer ``group_ids`` [B] (rows need not be contiguous); rows not ``valid`` (empty
completion) are out of every statistic and get 0. A group of one has no baseline (std ddof=1 is
0), so grpo, dr_grpo and rloo give it 0. ``OUTCOME``: (rewards, group_ids, valid, eps) -> [B]."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from rlax_tasks.algorithms import names
from rlax_tasks.algorithms.masked import masked_max, masked_mean, masked_std


class GroupStats(NamedTuple):
    """Per-row statistics of the row's group: size, mean, R − mean and unbiased std."""

    count: Array
    mean: Array
    deviation: Array
    std: Array


def group_statistics(rewards: Array, group_ids: Array, valid: Array) -> GroupStats:
    """Group size, mean, deviation R − mean and ddof=1 std, gathered back to every row [B].

    Sums are taken relative to the group's maximum, so a constant group has deviation and std
    exactly 0 in any precision (no rounding noise amplified by the 1/(std + eps) of GRPO).
    """
    b = rewards.shape[0]
    _, segment = jnp.unique(group_ids, size=b, return_inverse=True)
    segment = segment.reshape(b)
    w = valid.astype(rewards.dtype)

    def gather_sum(x: Array) -> Array:
        return jax.ops.segment_sum(x * w, segment, num_segments=b)[segment]

    shift = jax.ops.segment_max(jnp.where(valid, rewards, -jnp.inf), segment, num_segments=b)
    shifted = jnp.where(valid, rewards - shift[segment], 0.0)
    count = gather_sum(jnp.ones_like(rewards))
    shifted_mean = gather_sum(shifted) / jnp.maximum(count, 1.0)
    deviation = shifted - shifted_mean
    sq = gather_sum(jnp.square(deviation))
    std = jnp.where(count > 1, jnp.sqrt(sq / jnp.maximum(count - 1.0, 1.0)), 0.0)
    mean = jnp.where(valid, rewards - deviation, 0.0)
    return GroupStats(count, mean, jnp.where(valid, deviation, 0.0), std)


def grpo_advantages(rewards: Array, group_ids: Array, valid: Array, eps: float) -> Array:
    """(R − mean_g R) / (std_g R + eps), unbiased group std (GRPO)."""
    g = group_statistics(rewards, group_ids, valid)
    return jnp.where(valid, g.deviation / (g.std + eps), 0.0)


def dr_grpo_advantages(rewards: Array, group_ids: Array, valid: Array, eps: float) -> Array:
    """R − mean_g R (Dr. GRPO: no std normalization)."""
    g = group_statistics(rewards, group_ids, valid)
    return g.deviation


def rloo_advantages(rewards: Array, group_ids: Array, valid: Array, eps: float) -> Array:
    """R_b − mean of the other rewards of its group (leave-one-out baseline); 0 for singletons."""
    g = group_statistics(rewards, group_ids, valid)
    # R_b − (Σ_g R − R_b)/(n − 1) = n/(n − 1)·(R_b − mean_g R)
    scale = g.count / jnp.maximum(g.count - 1.0, 1.0)
    return jnp.where(valid & (g.count > 1), scale * g.deviation, 0.0)


def batch_norm_advantages(rewards: Array, group_ids: Array, valid: Array, eps: float) -> Array:
    """(R − mean_B R) / (std_B R + eps) over the valid rows of the batch (REINFORCE++)."""
    w = valid.astype(rewards.dtype)
    shifted = rewards - masked_max(rewards, w)  # exact 0 deviation for a constant batch
    deviation = shifted - masked_mean(shifted, w)
    return jnp.where(valid, deviation / (masked_std(shifted, w) + eps), 0.0)


def group_batch_norm_advantages(
    rewards: Array, group_ids: Array, valid: Array, eps: float
) -> Array:
    """R − mean_g R, then normalized over the batch (REINFORCE++ with a group baseline)."""
    deviation = dr_grpo_advantages(rewards, group_ids, valid, eps)
    return batch_norm_advantages(deviation, group_ids, valid, eps)


OUTCOME: dict[str, Callable[[Array, Array, Array, float], Array]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "batch_norm": batch_norm_advantages,
    "group_batch_norm": group_batch_norm_advantages,
}
names.check_table(OUTCOME, names.OUTCOME_ADV_MODES, "outcome advantage")
