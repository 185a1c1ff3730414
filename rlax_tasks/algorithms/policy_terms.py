"""Gradient terms of DESIGN §4: GradTerm1 (policy-gradient term, multiplied by the advantage)
and GradTerm2 (KL to a reference policy). Each returns per-token values [B, T] whose gradient
with respect to ``logp`` is the intended one; masks and clipping decisions are stop-gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array


def ppo_clip_mask(ratio: Array, adv: Array, eps_low: float, eps_high: float) -> Array:
    """M = 0 where (A > 0 and r > 1+ε_high) or (A < 0 and r < 1−ε_low), else 1."""
    clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    return jax.lax.stop_gradient(1.0 - clipped.astype(ratio.dtype))


def ppo_clip_term(ratio: Array, adv: Array, eps_low: float, eps_high: float) -> Array:
    """GradTerm1 ``ppo_clip``: M·r (same gradient as PPO's clipped surrogate)."""
    return ppo_clip_mask(ratio, adv, eps_low, eps_high) * ratio


def logp_term(logp: Array) -> Array:
    """GradTerm1 ``logp``: the REINFORCE term (CISPO puts its clipped ratio in IS)."""
    return logp


def sequence_ratio(logp: Array, old: Array, mask: Array) -> Array:
    """GSPO's s_b = exp(mean_t m·(logp − old)) per row [B]."""
    mask = mask.astype(jnp.float32)
    log_ratio = jnp.where(mask > 0, logp - old, 0.0)
    mean = jnp.sum(log_ratio * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jnp.exp(mean)


def gspo_term(
    logp: Array, old: Array, seq_adv: Array, mask: Array, eps_low: float, eps_high: float
) -> tuple[Array, Array]:
    """GradTerm1 ``gspo``: M_b·s_b broadcast over the row's tokens, and M_b [B].

    With per-sequence token-mean aggregation (``individual``) this is one term per sequence,
    (1/B)·Σ_b M_b·s_b·A_b, as in the GSPO paper.
    """
    s = sequence_ratio(logp, old, mask)
    m = ppo_clip_mask(s, seq_adv, eps_low, eps_high)
    return jnp.broadcast_to((m * s)[:, None], logp.shape), m


def kl_k3_term(logp: Array, ref: Array, mask: Array, beta: float) -> Array:
    """GradTerm2 ``k3``: −β·(e^{ref−logp} − (ref−logp) − 1); 0 off the mask."""
    d = jnp.where(mask > 0, ref - logp, 0.0)
    return -beta * (jnp.exp(d) - d - 1.0)


def kl_k2_term(logp: Array, ref: Array, mask: Array, beta: float) -> Array:
    """GradTerm2 ``k2``: −β·½(logp − ref)²; 0 off the mask."""
    d = jnp.where(mask > 0, logp - ref, 0.0)
    return -beta * 0.5 * jnp.square(d)


def k3_estimate(logp: Array, ref: Array, mask: Array) -> Array:
    """Per-token k3 estimate of KL(π ‖ π_ref) (non-negative, unbiased on-policy)."""
    d = jnp.where(mask > 0, ref - logp, 0.0)
    return jnp.exp(d) - d - 1.0
