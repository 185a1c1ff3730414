"""Importance weights (IS slot of docs/design.md §4) as lookup tables, always stop-gradient.

``BEHAVIOR_IS``: truncated (TIS) or masked (MIS) IS by the old/behaviour (sampler) ratio, per
token or per sequence, for mismatch and staleness; ``RATIO_IS``: CISPO's clipped current/old
ratio. Each returns (weight, clipped, truncated or masked 0/1) [B, T]; log-ratios are capped
before ``exp`` so huge mismatches never overflow."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from rlax_tasks.algorithms import names

IsOutput = tuple[Array, Array]  # (stop-gradient weight, 0/1 where it was clipped or truncated)


def _truncated(log_ratio: Array, cap: float) -> IsOutput:
    """min(exp(log_ratio), C) and where the cap C was hit."""
    weight = jax.lax.stop_gradient(jnp.exp(jnp.minimum(log_ratio, math.log(cap))))
    return weight, (log_ratio > math.log(cap)).astype(jnp.float32)


def _masked(log_ratio: Array, cap: float) -> IsOutput:
    """exp(log_ratio) inside [1/C, C], 0 outside (MIS), and where it was masked."""
    bound = math.log(cap)
    inside = jnp.abs(log_ratio) <= bound
    weight = jnp.where(inside, jnp.exp(jnp.clip(log_ratio, -bound, bound)), 0.0)
    return jax.lax.stop_gradient(weight), (~inside).astype(jnp.float32)


def _token_log_ratio(old: Array, behavior: Array, mask: Array) -> Array:
    """old − beh on completion tokens, 0 elsewhere."""
    return jnp.where(mask > 0, old - behavior, 0.0)


def _sequence_log_ratio(old: Array, behavior: Array, mask: Array) -> Array:
    """Σ_t m·(old − beh) of each row, broadcast over its tokens."""
    total = jnp.sum(_token_log_ratio(old, behavior, mask), axis=1, keepdims=True)
    return jnp.broadcast_to(total, mask.shape)


def no_behavior_is(old: Array, behavior: Array | None, mask: Array, cap: float) -> IsOutput:
    """``none``: weight 1, nothing truncated."""
    return jnp.ones(mask.shape, jnp.float32), jnp.zeros(mask.shape, jnp.float32)


def token_behavior_is(old: Array, behavior: Array, mask: Array, cap: float) -> IsOutput:
    """``token`` TIS: min(exp(old − beh), C) per token; 1 off the mask."""
    return _truncated(_token_log_ratio(old, behavior, mask), cap)


def sequence_behavior_is(old: Array, behavior: Array, mask: Array, cap: float) -> IsOutput:
    """``sequence`` TIS: min(exp(Σ_t m·(old − beh)), C), the truncated likelihood ratio of the
    whole completion, broadcast over its tokens."""
    return _truncated(_sequence_log_ratio(old, behavior, mask), cap)


def token_behavior_mis(old: Array, behavior: Array, mask: Array, cap: float) -> IsOutput:
    """``token_mis``: exp(old − beh) where it lies in [1/C, C], else 0 (the token is masked out
    of the gradient but still counts in Agg's denominators); 1 off the mask."""
    return _masked(_token_log_ratio(old, behavior, mask), cap)


def sequence_behavior_mis(old: Array, behavior: Array, mask: Array, cap: float) -> IsOutput:
    """``sequence_mis``: the completion's likelihood ratio exp(Σ_t m·(old − beh)) where it lies
    in [1/C, C], else 0 for every token of the sequence."""
    return _masked(_sequence_log_ratio(old, behavior, mask), cap)


def no_ratio_is(ratio: Array, eps_low: float, eps_high: float) -> IsOutput:
    """``none``: weight 1, nothing clipped."""
    return jnp.ones(ratio.shape, jnp.float32), jnp.zeros(ratio.shape, jnp.float32)


def clip_ratio_is(ratio: Array, eps_low: float, eps_high: float) -> IsOutput:
    """``clip`` (CISPO): sg[clip(r, 1 − ε_low, 1 + ε_high)], and where r lies outside."""
    outside = (ratio < 1.0 - eps_low) | (ratio > 1.0 + eps_high)
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
    return weight, outside.astype(jnp.float32)


RATIO_IS: dict[str, Callable[[Array, float, float], IsOutput]] = {
    "none": no_ratio_is,
    "clip": clip_ratio_is,
}
BEHAVIOR_IS: dict[str, Callable[[Array, Array, Array, float], IsOutput]] = {
    "none": no_behavior_is,
    "token": token_behavior_is,
    "sequence": sequence_behavior_is,
    "token_mis": token_behavior_mis,
    "sequence_mis": sequence_behavior_mis,
}
names.check_table(RATIO_IS, names.RATIO_IS_MODES, "ratio IS")
names.check_table(BEHAVIOR_IS, names.BEHAVIOR_IS_MODES, "behaviour IS")
