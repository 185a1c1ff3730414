"""Gradient terms of docs/design.md §4 as lookup tables: GradTerm1 (``POLICY_TERMS``, times the
advantage) and GradTerm2 (``KL_TERMS``, KL to a reference policy). Each returns per-token values
[B, T] with the docs/design.md §4 gradient in ``logp``; masks and clip decisions are
stop-gradient, and a clipped term's VALUE is the clipped surrogate verl and TRL report (a constant
where the gradient is 0). Adding a term: one function, one entry in its table, its name in
``names.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import Array

from rlax_tasks.algorithms import names
from rlax_tasks.algorithms.config import ObjectiveConfig


class PolicyInputs(NamedTuple):
    """Token arrays [B, T] a policy term reads; only ``logp`` carries a gradient."""

    logp: Array  # current log-probs, 0 off the mask
    old: Array  # old-policy log-probs
    ratio: Array  # r = exp(logp − old), 1 off the mask
    adv: Array  # stop-gradient advantages, 0 off the mask
    mask: Array  # 1 on completion tokens


class PolicyOutput(NamedTuple):
    """GradTerm1 [B, T] and where its gradient is clipped away (0/1 floats [B, T])."""

    term: Array
    clipped: Array  # the PPO/GSPO mask is 0
    dual_clipped: Array  # Adv < 0 and r > clip_ratio_c (ppo_clip's dual clip)


PolicyTerm = Callable[[PolicyInputs, ObjectiveConfig], PolicyOutput]
KlTerm = Callable[[Array, Array, Array, float], Array]


def ppo_clip_mask(ratio: Array, adv: Array, eps_low: float, eps_high: float) -> Array:
    """M = 0 where (A > 0 and r > 1+ε_high) or (A < 0 and r < 1−ε_low), else 1."""
    clipped = ((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low))
    return jax.lax.stop_gradient(1.0 - clipped.astype(ratio.dtype))


def dual_clip_mask(ratio: Array, adv: Array, clip_ratio_c: float) -> Array:
    """1 where verl's dual clip caps the loss of a negative-advantage token: A < 0 and r > c."""
    return ((adv < 0) & (ratio > clip_ratio_c)).astype(ratio.dtype)


def _surrogate(ratio: Array, keep: Array, bound: Array) -> Array:
    """keep·r + sg[(1 − keep)·bound]: the gradient of keep·r, the clipped surrogate's value."""
    return keep * ratio + jax.lax.stop_gradient((1.0 - keep) * bound)


def ppo_clip(x: PolicyInputs, c: ObjectiveConfig) -> PolicyOutput:
    """``ppo_clip``: M·r (PPO's clipped-surrogate gradient), with verl's dual clip when
    ``clip_ratio_c`` is set: Adv < 0 and r > c gives the constant c (loss −Adv·c, no gradient)."""
    keep = ppo_clip_mask(x.ratio, x.adv, c.eps_low, c.eps_high)
    bound = jnp.clip(x.ratio, 1.0 - c.eps_low, 1.0 + c.eps_high)
    dual, grad_keep = jnp.zeros_like(keep), keep
    if c.clip_ratio_c is not None:
        dual = dual_clip_mask(x.ratio, x.adv, c.clip_ratio_c)
        grad_keep = keep * (1.0 - dual)
        bound = jnp.where(dual > 0, c.clip_ratio_c, bound)
    return PolicyOutput(_surrogate(x.ratio, grad_keep, bound), 1.0 - keep, dual)


def logp(x: PolicyInputs, c: ObjectiveConfig) -> PolicyOutput:
    """``logp``: the REINFORCE term (CISPO puts its clipped ratio in IS); never clipped."""
    zeros = jnp.zeros(x.logp.shape, jnp.float32)
    return PolicyOutput(x.logp, zeros, zeros)


def sequence_ratio(logp: Array, old: Array, mask: Array) -> Array:
    """GSPO's s_b = exp(mean_t m·(logp − old)) per row [B]."""
    mask = mask.astype(jnp.float32)
    log_ratio = jnp.where(mask > 0, logp - old, 0.0)
    mean = jnp.sum(log_ratio * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jnp.exp(mean)


def gspo(x: PolicyInputs, c: ObjectiveConfig) -> PolicyOutput:
    """``gspo``: M_b·s_b broadcast over the row's tokens, M_b the PPO mask of the sequence.

    With per-sequence token-mean aggregation (``individual``) this is one term per sequence,
    (1/B)·Σ_b M_b·s_b·A_b, as in the GSPO paper.
    """
    seq_adv = jnp.sum(x.adv, axis=1) / jnp.maximum(jnp.sum(x.mask, axis=1), 1.0)
    s = sequence_ratio(x.logp, x.old, x.mask)
    keep = ppo_clip_mask(s, seq_adv, c.eps_low, c.eps_high)
    term = _surrogate(s, keep, jnp.clip(s, 1.0 - c.eps_low, 1.0 + c.eps_high))
    shape = x.logp.shape
    clipped = jnp.broadcast_to((1.0 - keep)[:, None], shape)
    return PolicyOutput(jnp.broadcast_to(term[:, None], shape), clipped, jnp.zeros(shape))


POLICY_TERMS: dict[str, PolicyTerm] = {"ppo_clip": ppo_clip, "logp": logp, "gspo": gspo}


def no_kl(logp: Array, ref: Array | None, mask: Array, beta: float) -> Array:
    """GradTerm2 ``none``: 0."""
    return jnp.zeros(logp.shape, jnp.float32)


def kl_k3(logp: Array, ref: Array, mask: Array, beta: float) -> Array:
    """GradTerm2 ``k3``: −β·(e^{ref−logp} − (ref−logp) − 1); 0 off the mask."""
    return -beta * k3_estimate(logp, ref, mask)


def kl_k2(logp: Array, ref: Array, mask: Array, beta: float) -> Array:
    """GradTerm2 ``k2``: −β·½(logp − ref)²; 0 off the mask."""
    d = jnp.where(mask > 0, logp - ref, 0.0)
    return -beta * 0.5 * jnp.square(d)


KL_TERMS: dict[str, KlTerm] = {"none": no_kl, "k3": kl_k3, "k2": kl_k2}


def k3_estimate(logp: Array, ref: Array, mask: Array) -> Array:
    """Per-token k3 estimate of KL(π ‖ π_ref) (non-negative, unbiased on-policy)."""
    d = jnp.where(mask > 0, ref - logp, 0.0)
    return jnp.exp(d) - d - 1.0


names.check_table(POLICY_TERMS, names.POLICY_TERMS, "policy term")
names.check_table(KL_TERMS, names.KL_TERMS, "KL term")
