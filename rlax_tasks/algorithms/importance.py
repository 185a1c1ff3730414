"""Importance weights (IS slot of DESIGN §4), always stop-gradient.

Truncated IS (TIS) corrects for the sampler/trainer mismatch and staleness with the ratio of
the trainer's old policy to the behaviour (sampler) policy; CISPO clips the current/old ratio.
Log-ratios are capped before ``exp`` so huge mismatches never overflow.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import Array


def truncated_token_is(old: Array, behavior: Array, mask: Array, cap: float) -> Array:
    """Per token min(exp(old − beh), C); 1 off the mask."""
    log_ratio = jnp.where(mask > 0, old - behavior, 0.0)
    return jax.lax.stop_gradient(jnp.exp(jnp.minimum(log_ratio, math.log(cap))))


def truncated_sequence_is(old: Array, behavior: Array, mask: Array, cap: float) -> Array:
    """Per sequence min(exp(Σ_t m·(old − beh)), C), the truncated likelihood ratio of the whole
    completion, broadcast over its tokens [B, T]."""
    log_ratio = jnp.sum(jnp.where(mask > 0, old - behavior, 0.0), axis=1, keepdims=True)
    weight = jnp.exp(jnp.minimum(log_ratio, math.log(cap)))
    return jax.lax.stop_gradient(jnp.broadcast_to(weight, mask.shape))


def behavior_log_ratio_over_cap(
    old: Array, behavior: Array, mask: Array, cap: float, level: str
) -> Array:
    """Boolean [B, T]: where the TIS weight of ``level`` (token/sequence) hit the cap C."""
    log_ratio = jnp.where(mask > 0, old - behavior, 0.0)
    if level == "sequence":
        log_ratio = jnp.broadcast_to(jnp.sum(log_ratio, axis=1, keepdims=True), mask.shape)
    return log_ratio > math.log(cap)


def clipped_ratio_is(ratio: Array, eps_low: float, eps_high: float) -> Array:
    """CISPO's sg[clip(r, 1 − ε_low, 1 + ε_high)]."""
    return jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high))
