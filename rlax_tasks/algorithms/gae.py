"""GAE advantages and the clipped value loss for PPO with a value head (Adv slot "gae").

``values[b, t]``: V of the state before completion token t (the log-probs' shift). R_b goes to
the last completion token, 0 to the others, and the state after it is terminal. The recursion
runs over each row's completion tokens in order, bridging masked gaps (e.g. tool outputs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from rlax_tasks.algorithms.masked import masked_mean, masked_std


def terminal_rewards(rewards: Array, mask: Array) -> Array:
    """Token rewards [B, T]: R_b on the last completion token of row b, 0 elsewhere."""
    t = mask.shape[1]
    idx = jnp.arange(t)
    last = jnp.max(jnp.where(mask > 0, idx, -1), axis=1)
    return jnp.where(idx[None, :] == last[:, None], rewards[:, None], 0.0).astype(jnp.float32)


def gae(
    rewards: Array, values: Array, mask: Array, gamma: float, lam: float
) -> tuple[Array, Array]:
    """GAE(γ, λ) advantages and returns (= advantages + values) [B, T]; 0 off the mask.

    δ_t = r_t + γ·V_next − V_t,  A_t = δ_t + γλ·A_next, where "next" is the next completion
    token of the row (V_next = A_next = 0 after the last one).
    """
    mask = mask.astype(jnp.float32)
    values = jnp.where(mask > 0, values.astype(jnp.float32), 0.0)
    token_rewards = terminal_rewards(rewards.astype(jnp.float32), mask)

    def step(carry, xs):
        next_value, next_adv = carry
        r, v, m = xs
        delta = r + gamma * next_value - v
        adv = delta + gamma * lam * next_adv
        keep = m > 0
        carry = (jnp.where(keep, v, next_value), jnp.where(keep, adv, next_adv))
        return carry, jnp.where(keep, adv, 0.0)

    zeros = jnp.zeros(mask.shape[0], jnp.float32)
    xs = (token_rewards.T, values.T, mask.T)
    _, adv = jax.lax.scan(step, (zeros, zeros), xs, reverse=True)
    adv = adv.T
    return adv, jnp.where(mask > 0, adv + values, 0.0)


def whiten(x: Array, mask: Array, eps: float) -> Array:
    """(x − mean) / (std + eps) over the masked entries (ddof=1); 0 off the mask."""
    mean, std = masked_mean(x, mask), masked_std(x, mask)
    return jnp.where(mask > 0, (x - mean) / (std + eps), 0.0)


def clipped_value_loss(
    values: Array, old_values: Array, returns: Array, clip: float | None
) -> Array:
    """Per-token ½·max((V − G)², (V_clip − G)²), V_clip = V_old + clip(V − V_old, ±clip)."""
    unclipped = jnp.square(values - returns)
    if clip is None:
        return 0.5 * unclipped
    v_clip = old_values + jnp.clip(values - old_values, -clip, clip)
    return 0.5 * jnp.maximum(unclipped, jnp.square(v_clip - returns))
