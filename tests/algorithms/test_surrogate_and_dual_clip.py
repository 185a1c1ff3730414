"""The loss value is the clipped surrogate verl/TRL report, the gradient is unchanged, and
verl's dual clip (``clip_ratio_c``) agrees with an independent NumPy implementation of verl's
formula (docs/design.md §4)."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tasks.algorithms import PRESETS, ObjectiveConfigError, make_objective
from tests.algorithms import numpy_reference as ref_impl
from tests.algorithms.batches import as64, jax_batch, make_batch

# d loss / d logp of every preset (behavior_is none/token, batch seeds 0/7) computed with the
# objective as it was before the loss value became the clipped surrogate (loss = −J literally)
MASKED_FORM_GRADIENTS = Path(__file__).parent / "data" / "masked_form_gradients.npz"
DUAL_C = 1.3


def _loss_and_grad(obj, logp, batch):
    fn = jax.jit(jax.value_and_grad(obj.loss, has_aux=True))
    (loss, metrics), grad = fn(jnp.asarray(logp), jax_batch(batch))
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad, np.float64)


def _verl_token_losses(cfg, logp, b64):
    """Weighted per-token loss [B, T] by verl's formula, written from scratch in float64.

    pg = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high)); with the dual clip, for A < 0:
    pg = min(pg, −A·c). Plus β·k3 when the preset has a KL term; Agg weights as docs/design.md §4.
    """
    mask = b64["mask"] > 0
    adv = ref_impl.token_advantages(cfg, b64)
    ratio = np.exp(np.where(mask, logp - b64["old_logprobs"], 0.0))
    clipped = np.clip(ratio, 1 - cfg.eps_low, 1 + cfg.eps_high)
    pg = np.maximum(-adv * ratio, -adv * clipped)
    if cfg.clip_ratio_c is not None:
        pg = np.where(adv < 0, np.minimum(pg, -adv * cfg.clip_ratio_c), pg)
    if cfg.kl == "k3" and cfg.kl_beta > 0:
        d = np.where(mask, b64["ref_logprobs"] - logp, 0.0)
        pg = pg + cfg.kl_beta * (np.exp(d) - d - 1)
    lengths = mask.sum(1)
    n_seq = (lengths > 0).sum()
    if cfg.agg == "individual":
        w = 1.0 / (n_seq * np.maximum(lengths, 1))[:, None]
    else:
        assert cfg.agg == "group"
        w = 1.0 / lengths.sum()
    return np.where(mask, w * pg, 0.0)


def _verl_loss_and_grad(cfg, logp, b64, h=1e-6):
    """Loss and its gradient by central differences (each token's loss depends on its logp)."""
    up = _verl_token_losses(cfg, logp + h, b64)
    down = _verl_token_losses(cfg, logp - h, b64)
    return _verl_token_losses(cfg, logp, b64).sum(), (up - down) / (2 * h)


@pytest.mark.parametrize("name", ["grpo", "dapo"])
@pytest.mark.parametrize("dual", [None, DUAL_C])
def test_loss_value_and_gradient_match_verl(name, dual):
    obj = make_objective(name, clip_ratio_c=dual)
    logp, batch = make_batch(39, ratio_scale=1.0)
    b64 = as64(batch)
    x = logp.astype(np.float64)
    verl_loss, verl_grad = _verl_loss_and_grad(obj.config, x, b64)
    loss, metrics, grad = _loss_and_grad(obj, logp, batch)

    on = b64["mask"] > 0
    adv = ref_impl.token_advantages(obj.config, b64)
    ratio = np.exp(x - b64["old_logprobs"])
    low = (adv < 0) & (ratio < 1 - obj.config.eps_low)
    high = (adv > 0) & (ratio > 1 + obj.config.eps_high)
    beyond_c = on & (adv < 0) & (ratio > DUAL_C)
    assert (on & (low | high)).sum() > 3 and beyond_c.sum() > 3  # both clips are exercised

    # the loss value is verl's clipped surrogate (not the masked form's −J)
    np.testing.assert_allclose(loss, verl_loss, rtol=1e-6)
    # the gradient agrees with verl's to 1e-8 (float32 objective, float64 reference)
    np.testing.assert_allclose(grad, verl_grad, rtol=0, atol=1e-8)
    # and so does the float64 NumPy reference of the masked form
    ref = ref_impl.objective(obj.config, x, b64)
    np.testing.assert_allclose(ref.grad, verl_grad, rtol=0, atol=1e-9)
    np.testing.assert_allclose(ref.loss, verl_loss, rtol=1e-12)

    n = on.sum()
    np.testing.assert_allclose(metrics["clip_frac"], (on & (low | high)).sum() / n, rtol=1e-6)
    expected_dual = beyond_c.sum() / n if dual is not None else 0.0
    np.testing.assert_allclose(metrics["dual_clip_frac"], expected_dual, rtol=1e-6)
    assert ref.dual_clipped_tokens == (beyond_c.sum() if dual is not None else 0)
    if dual is not None and not obj.needs_reference:  # no policy gradient past the bound
        assert np.all(grad[beyond_c] == 0.0)
    else:
        assert np.all(grad[beyond_c] != 0.0)


@pytest.mark.parametrize("name", list(PRESETS))
def test_gradient_is_unchanged_by_the_surrogate_value(name):
    """The stop-gradient constants change the loss value only: d loss / d logp is what the masked
    form gave (recorded in MASKED_FORM_GRADIENTS), up to float32 rounding (identical bit for bit
    where recorded; another CPU or XLA build may fuse differently)."""
    recorded = np.load(MASKED_FORM_GRADIENTS)
    for mode in ("none", "token"):
        obj = make_objective(name, behavior_is=mode)
        for seed in (0, 7):
            logp, batch = make_batch(seed)
            _, _, grad = _loss_and_grad(obj, logp, batch)
            np.testing.assert_allclose(
                grad, recorded[f"{name}-{mode}-{seed}"], rtol=1e-6, atol=1e-9
            )


@pytest.mark.parametrize("value", [1.0, 0.5, -2.0, float("inf"), "2"])
def test_clip_ratio_c_must_exceed_one(value):
    with pytest.raises(ObjectiveConfigError, match="^clip_ratio_c must"):
        make_objective("grpo", clip_ratio_c=value)


def test_clip_ratio_c_belongs_to_ppo_clip():
    with pytest.raises(ObjectiveConfigError, match="clip_ratio_c is the dual clip"):
        make_objective("cispo", clip_ratio_c=3.0)
    assert make_objective("grpo").config.clip_ratio_c is None
    assert make_objective("dapo", clip_ratio_c=3.0).config.clip_ratio_c == 3.0
