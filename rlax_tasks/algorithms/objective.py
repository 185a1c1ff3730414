"""The composable RL objective of docs/design.md §4 and ``make_objective`` (presets + overrides):
J = Σ_b Σ_t m·sg[Agg·IS]·(sg[Adv]·GradTerm1 + GradTerm2), loss = −J, r = exp(logp − old).
Gradients flow through ``logp`` only and are exactly J's; a clipped term's loss VALUE is the
clipped surrogate verl and TRL report (dual clip included). Each slot is a lookup table named in
``names.py``; the PPO value loss is separate (``value_loss``): the trainer weighs it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax import Array

from rlax_tasks.algorithms import advantages as adv_lib
from rlax_tasks.algorithms import gae as gae_lib
from rlax_tasks.algorithms import importance, names, policy_terms
from rlax_tasks.algorithms.aggregation import token_weights
from rlax_tasks.algorithms.config import ObjectiveConfig, preset_config
from rlax_tasks.algorithms.masked import (
    masked_max,
    masked_mean,
    masked_min,
    masked_quantile,
    masked_std,
    masked_sum,
)

Batch = Mapping[str, Any]


class BatchError(ValueError):
    """A batch is missing a key the objective needs, or has a key of the wrong shape."""


def _token_array(batch: Batch, key: str, shape: tuple[int, ...], why: str = "") -> Array:
    if key not in batch or batch[key] is None:
        raise BatchError(f"batch has no {key!r}{why}")
    x = jnp.asarray(batch[key])
    if x.shape != shape:
        raise BatchError(f"batch[{key!r}] has shape {x.shape}, expected {shape}")
    return x


def _core(batch: Batch, shape: tuple[int, int]) -> tuple[Array, Array, Array, Array]:
    """(mask float32 0/1, valid rows, rewards float32, group_ids) with shapes checked."""
    b, _ = shape
    mask = (_token_array(batch, "mask", shape) > 0).astype(jnp.float32)
    rewards = _token_array(batch, "rewards", (b,)).astype(jnp.float32)
    group_ids = _token_array(batch, "group_ids", (b,))
    if not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise BatchError(f"batch['group_ids'] must be integers, got dtype {group_ids.dtype}")
    return mask, jnp.sum(mask, axis=1) > 0, rewards, group_ids


@dataclasses.dataclass(frozen=True)
class Objective:
    """A configured docs/design.md §4 objective: ``loss``, ``advantages`` and (ppo)
    ``value_loss``."""

    name: str
    config: ObjectiveConfig

    @property
    def needs_reference(self) -> bool:
        """Whether ``batch["ref_logprobs"]`` is required (a KL term with β > 0)."""
        return self.config.needs_reference

    @property
    def needs_values(self) -> bool:
        """Whether ``batch["values"]`` (value-head outputs) is required (adv="gae")."""
        return self.config.needs_values

    # ---------------------------------------------------------------- advantages
    def advantages(self, batch: Batch) -> Array:
        """Stop-gradient token advantages [B, T] (0 off the mask) of the whole batch (jitted)."""
        keys = ("mask", "rewards", "group_ids", "values")
        return _advantages(self.config, {k: batch[k] for k in keys if batch.get(k) is not None})

    # ---------------------------------------------------------------- policy loss
    def loss(self, logp: Array, batch: Batch) -> tuple[Array, dict[str, Array]]:
        """(−J, metrics) for the current policy's log-probs ``logp`` [B, T]. ``batch``:
        "old_logprobs", "mask" [B, T] (1 on completion tokens; all-zero rows are padding),
        "rewards" [B], int "group_ids" [B]; as configured "behavior_logprobs", "ref_logprobs",
        "values"; "advantages", "num_sequences", "num_tokens" of the full batch: exact shares."""
        c = self.config
        logp = jnp.asarray(logp).astype(jnp.float32)
        if logp.ndim != 2:
            raise BatchError(f"logp must be [B, T], got shape {logp.shape}")
        shape = tuple(logp.shape)
        mask, valid, _, _ = _core(batch, shape)
        old = jax.lax.stop_gradient(_token_array(batch, "old_logprobs", shape)).astype(jnp.float32)
        adv = self._batch_advantages(batch, shape) * mask
        on = mask > 0
        x = policy_terms.PolicyInputs(
            logp=jnp.where(on, logp, 0.0),
            old=old,
            ratio=jnp.exp(jnp.where(on, logp - old, 0.0)),
            adv=adv,
            mask=mask,
        )
        weights = self._weights(mask, batch)

        # IS: product of CISPO's clipped ratio and the truncated behaviour correction.
        ratio_w, ratio_clipped = importance.RATIO_IS[c.ratio_is](x.ratio, c.eps_low, c.eps_high)
        beh = None
        if c.behavior_is != "none":
            why = f" (behavior_is={c.behavior_is!r} needs the sampler's log-probs)"
            beh = _token_array(batch, "behavior_logprobs", shape, why).astype(jnp.float32)
            beh = jax.lax.stop_gradient(beh)
        beh_w, beh_flag = importance.BEHAVIOR_IS[c.behavior_is](old, beh, mask, c.behavior_is_cap)
        # the 0/1 output of MIS marks masked tokens, that of TIS truncated ones
        masked_out = c.behavior_is in names.MIS_MODES
        beh_flag_frac = masked_mean(beh_flag, mask)
        is_w = jnp.ones(shape, jnp.float32) * ratio_w * beh_w

        # GradTerm1, and the tokens whose gradient is clipped away (or whose ratio is IS-clipped).
        term1 = policy_terms.POLICY_TERMS[c.policy_term](x, c)
        clipped = jnp.maximum(term1.clipped, ratio_clipped)

        # GradTerm2: KL to the reference policy.
        ref = self._reference(batch, shape)
        kl_term = policy_terms.KL_TERMS[c.kl if self.needs_reference else "none"]
        term2 = kl_term(x.logp, ref, mask, c.kl_beta)

        coef = jax.lax.stop_gradient(weights * is_w)
        pg = masked_sum(coef * adv * term1.term, mask)
        kl_part = masked_sum(coef * term2, mask)
        loss = -(pg + kl_part)

        metrics = {
            "loss": loss,
            "policy_loss": -pg,
            "kl_loss": -kl_part,
            "clip_frac": masked_mean(clipped, mask),
            "dual_clip_frac": masked_mean(term1.dual_clipped, mask),
            "ratio_mean": masked_mean(x.ratio, mask),
            "ratio_max": masked_max(x.ratio, mask),
            "is_weight_mean": masked_mean(is_w, mask),
            "is_weight_max": masked_max(is_w, mask),
            "is_weight_p95": masked_quantile(is_w, mask, 0.95),
            "is_truncated_frac": beh_flag_frac * (not masked_out),
            "is_masked_frac": beh_flag_frac * masked_out,
            "adv_mean": masked_mean(adv, mask),
            "adv_std": masked_std(adv, mask),
            "adv_min": masked_min(adv, mask),
            "adv_max": masked_max(adv, mask),
            "num_tokens": jnp.sum(mask),
            "num_sequences": jnp.sum(valid).astype(jnp.float32),
        }
        if ref is not None:
            metrics["kl"] = masked_mean(policy_terms.k3_estimate(x.logp, ref, mask), mask)
        return loss, jax.tree.map(lambda x: jax.lax.stop_gradient(x.astype(jnp.float32)), metrics)

    def _weights(self, mask: Array, batch: Batch) -> Array:
        """The Agg token weights, with the full batch's counts when the batch carries them."""
        return token_weights(
            mask,
            self.config.agg,
            max_length=self.config.max_length,
            num_sequences=batch.get("num_sequences"),
            num_tokens=batch.get("num_tokens"),
        )

    def _reference(self, batch: Batch, shape: tuple[int, ...]) -> Array | None:
        """Stop-gradient ``ref_logprobs`` when given; an error when the KL term needs them."""
        if batch.get("ref_logprobs") is None:
            if self.needs_reference:
                c = self.config
                raise BatchError(
                    f"batch has no 'ref_logprobs' (kl={c.kl!r} with kl_beta={c.kl_beta} needs "
                    "the reference policy's log-probs)"
                )
            return None
        ref = _token_array(batch, "ref_logprobs", shape).astype(jnp.float32)
        return jax.lax.stop_gradient(ref)

    def _batch_advantages(self, batch: Batch, shape: tuple[int, ...]) -> Array:
        """``batch["advantages"]`` ([B] or [B, T]) when given, else ``self.advantages``."""
        if "advantages" not in batch or batch["advantages"] is None:
            return self.advantages(batch)
        adv = jnp.asarray(batch["advantages"]).astype(jnp.float32)
        if adv.shape == shape[:1]:
            adv = jnp.broadcast_to(adv[:, None], shape)
        if adv.shape != shape:
            raise BatchError(
                f"batch['advantages'] has shape {adv.shape}, expected {shape[:1]} or {shape}"
            )
        return jax.lax.stop_gradient(adv)

    # ---------------------------------------------------------------- value loss
    def value_loss(self, values: Array, batch: Batch) -> tuple[Array, dict[str, Array]]:
        """Clipped value loss of value-head outputs ``values`` [B, T] against GAE returns, both
        from the rollout-time ``batch["values"]`` (stop-gradient; also the clipping anchor),
        aggregated with the config's Agg weights."""
        c = self.config
        values = jnp.asarray(values).astype(jnp.float32)
        shape = tuple(values.shape)
        mask, _, rewards, _ = _core(batch, shape)
        old_values = _token_array(batch, "values", shape, " (the value loss needs old values)")
        old_values = jax.lax.stop_gradient(old_values.astype(jnp.float32))
        _, returns = gae_lib.gae(rewards, old_values, mask, c.gamma, c.gae_lambda)
        returns = jax.lax.stop_gradient(returns)
        on = mask > 0
        v = jnp.where(on, values, 0.0)
        v_old = jnp.where(on, old_values, 0.0)
        per_token = gae_lib.clipped_value_loss(v, v_old, returns, c.value_clip)
        loss = masked_sum(self._weights(mask, batch) * per_token, mask)
        clip_active = jnp.zeros(shape, jnp.float32)
        if c.value_clip is not None:
            v_clip = v_old + jnp.clip(v - v_old, -c.value_clip, c.value_clip)
            clip_active = (jnp.square(v_clip - returns) > jnp.square(v - returns)).astype(
                jnp.float32
            )
        metrics = {
            "value_loss": loss,
            "value_clip_frac": masked_mean(clip_active, mask),
            "value_mean": masked_mean(v, mask),
            "return_mean": masked_mean(returns, mask),
        }
        return loss, jax.tree.map(jax.lax.stop_gradient, metrics)


@functools.partial(jax.jit, static_argnums=0)
def _advantages(c: ObjectiveConfig, batch: Batch) -> Array:
    if "mask" not in batch:
        raise BatchError("batch has no 'mask'")
    shape = tuple(jnp.shape(batch["mask"]))
    if len(shape) != 2:
        raise BatchError(f"batch['mask'] must be [B, T], got shape {shape}")
    mask, valid, rewards, group_ids = _core(batch, shape)
    if c.adv == "gae":
        values = _token_array(batch, "values", shape, " (adv='gae' needs value-head outputs)")
        adv, _ = gae_lib.gae(rewards, values, mask, c.gamma, c.gae_lambda)
        if c.whiten_advantages:
            adv = gae_lib.whiten(adv, mask, c.adv_eps)
    else:
        seq = adv_lib.OUTCOME[c.adv](rewards, group_ids, valid, c.adv_eps)
        adv = seq[:, None] * mask
    return jax.lax.stop_gradient(adv.astype(jnp.float32))


def make_objective(name: str, **overrides: Any) -> Objective:
    """The objective of preset ``name`` (grpo, dapo, ...) with field ``overrides``; an unknown
    preset or field, or an invalid value, raises ``ObjectiveConfigError`` naming it."""
    return Objective(name=name, config=preset_config(name, **overrides))
