"""Loss values and d loss / d logp of every preset against the NumPy reference (docs/design.md
§4)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tasks.algorithms import PRESETS, make_objective
from tests.algorithms import numpy_reference as ref_impl
from tests.algorithms.batches import as64, jax_batch, make_batch


def _jax_loss_and_grad(obj, logp, batch):
    fn = jax.jit(jax.value_and_grad(obj.loss, has_aux=True))
    (loss, metrics), grad = fn(jnp.asarray(logp), jax_batch(batch))
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad, np.float64)


def _finite_difference(cfg, logp, batch, h=1e-6):
    mask = batch["mask"] > 0
    x = logp.astype(np.float64)
    fd = np.zeros_like(x)
    for i, j in zip(*np.nonzero(mask), strict=True):
        up, down = x.copy(), x.copy()
        up[i, j] += h
        down[i, j] -= h
        loss_up = ref_impl.objective(cfg, up, batch, sg_logp=x).loss
        loss_down = ref_impl.objective(cfg, down, batch, sg_logp=x).loss
        fd[i, j] = (loss_up - loss_down) / (2 * h)
    return fd


def _check(name, overrides, seed=0):
    obj = make_objective(name, **overrides)
    cfg = obj.config
    logp, batch = make_batch(seed)
    b64 = as64(batch)
    ref = ref_impl.objective(cfg, logp.astype(np.float64), b64)

    # the analytic NumPy gradient is the derivative of the NumPy loss
    fd = _finite_difference(cfg, logp, b64)
    np.testing.assert_allclose(ref.grad, fd, rtol=1e-5, atol=1e-7)

    loss, metrics, grad = _jax_loss_and_grad(obj, logp, batch)
    scale = np.abs(ref.grad).max()
    assert scale > 0
    np.testing.assert_allclose(grad, ref.grad, rtol=2e-4, atol=2e-5 * scale)
    assert grad[batch["mask"] == 0].tolist() == [0.0] * int((batch["mask"] == 0).sum())
    np.testing.assert_allclose(loss, ref.loss, rtol=2e-4, atol=1e-6)
    assert metrics["loss"] == loss

    # advantage statistics over completion tokens
    on = batch["mask"] > 0
    adv = ref.adv[on]
    np.testing.assert_allclose(metrics["adv_mean"], adv.mean(), atol=2e-5)
    np.testing.assert_allclose(metrics["adv_std"], adv.std(ddof=1), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["adv_min"], adv.min(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["adv_max"], adv.max(), rtol=1e-4, atol=1e-6)
    # KL estimate (k3) whenever reference log-probs are given
    d = b64["ref_logprobs"][on] - logp.astype(np.float64)[on]
    np.testing.assert_allclose(metrics["kl"], np.mean(np.exp(d) - d - 1), rtol=1e-4)
    assert metrics["num_sequences"] == 9 and metrics["num_tokens"] == ref.completion_tokens
    return cfg, ref, metrics, logp, b64


CASES = [
    (name, {"behavior_is": mode}) for name in PRESETS for mode in ("none", "token", "sequence")
] + [
    (name, {"behavior_is": mode})
    for name in ("grpo", "dapo", "cispo", "gspo", "reinforce_seq")
    for mode in ("token_mis", "sequence_mis")
]


@pytest.mark.parametrize(
    ("name", "overrides"), CASES, ids=[f"{n}-{o['behavior_is']}" for n, o in CASES]
)
def test_preset_gradient_matches_numpy(name, overrides):
    cfg, ref, metrics, logp, b64 = _check(name, overrides)
    n = ref.completion_tokens
    # clipping and truncation actually happen (and not everywhere)
    if cfg.policy_term in ("ppo_clip", "gspo"):
        assert 0 < ref.clipped_tokens < n
        if cfg.ratio_is == "none":
            np.testing.assert_allclose(metrics["clip_frac"], ref.clipped_tokens / n, rtol=1e-6)
    if cfg.ratio_is == "clip":
        on = b64["mask"] > 0
        r = np.exp(logp.astype(np.float64)[on] - b64["old_logprobs"][on])
        outside = (r > 1 + cfg.eps_high) | (r < 1 - cfg.eps_low)
        assert 0 < outside.sum() < n
        np.testing.assert_allclose(metrics["clip_frac"], outside.mean(), rtol=1e-6)
    if cfg.behavior_is == "none":
        assert metrics["is_truncated_frac"] == 0.0
        assert metrics["is_masked_frac"] == 0.0
    elif cfg.behavior_is.endswith("_mis"):
        assert 0 < ref.masked_tokens < n and metrics["is_truncated_frac"] == 0.0
        np.testing.assert_allclose(metrics["is_masked_frac"], ref.masked_tokens / n, rtol=1e-6)
        assert metrics["is_weight_max"] <= cfg.behavior_is_cap * (1 + cfg.eps_high) + 1e-6
    else:
        assert metrics["is_masked_frac"] == 0.0
        assert 0 < ref.truncated_tokens < n
        np.testing.assert_allclose(
            metrics["is_truncated_frac"], ref.truncated_tokens / n, rtol=1e-6
        )
        assert metrics["is_weight_max"] <= cfg.behavior_is_cap * (1 + cfg.eps_high) + 1e-6
        assert metrics["is_weight_p95"] <= metrics["is_weight_max"] + 1e-6
    if cfg.needs_reference:
        assert metrics["kl_loss"] != 0.0


OVERRIDES = [
    ("grpo", {"agg": "group", "behavior_is": "token"}),
    ("dapo", {"agg": "sequence", "eps_high": 0.3}),
    ("dr_grpo", {"max_length": 20, "behavior_is": "token"}),
    ("rloo", {"policy_term": "ppo_clip", "behavior_is": "sequence"}),
    ("reinforce_seq", {"agg": "max_length", "kl": "k3", "kl_beta": 0.1}),
    ("reinforce_pp", {"adv": "group_batch_norm", "kl": "k3", "kl_beta": 0.1}),
    ("gspo", {"kl": "k2", "kl_beta": 0.05, "eps_low": 0.02, "eps_high": 0.03}),
    ("cispo", {"eps_low": 0.1, "behavior_is": "token", "behavior_is_cap": 1.5}),
    ("ppo", {"whiten_advantages": False, "kl": "k3", "kl_beta": 0.02, "gamma": 0.9}),
    ("grpo", {"ratio_is": "clip", "eps_low": 0.1, "eps_high": 0.1}),
]


@pytest.mark.parametrize(("name", "overrides"), OVERRIDES)
def test_overridden_components_match_numpy(name, overrides):
    _check(name, overrides, seed=1)


def test_metrics_of_importance_weights_match_numpy():
    obj = make_objective("dapo", behavior_is="token", behavior_is_cap=1.5)
    logp, batch = make_batch(3)
    _, metrics, _ = _jax_loss_and_grad(obj, logp, batch)
    on = batch["mask"] > 0
    w = np.minimum(
        np.exp(batch["old_logprobs"][on].astype(np.float64) - batch["behavior_logprobs"][on]), 1.5
    )
    np.testing.assert_allclose(metrics["is_weight_mean"], w.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["is_weight_max"], w.max(), rtol=1e-6)
    np.testing.assert_allclose(metrics["is_weight_p95"], np.quantile(w, 0.95), rtol=1e-5)


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "ppo", "rloo"])
def test_micro_batches_add_up_to_the_full_batch(name):
    """With full-batch advantages and counts, micro-batch losses and gradients sum exactly."""
    obj = make_objective(name, behavior_is="token")
    logp, batch = make_batch(2)
    batch = jax_batch(batch)
    full_loss, _, full_grad = _jax_loss_and_grad(obj, logp, batch)
    adv = np.asarray(obj.advantages(batch))
    lengths = batch["mask"].sum(1)
    counts = {"num_sequences": float((lengths > 0).sum()), "num_tokens": float(lengths.sum())}
    total, grads = 0.0, np.zeros_like(full_grad)
    part_fn = jax.jit(jax.value_and_grad(obj.loss, has_aux=True))  # one compile for both halves
    for rows in (np.array([0, 2, 4, 6, 8]), np.array([1, 3, 5, 7, 9])):
        part = {k: v[rows] for k, v in batch.items()} | counts | {"advantages": adv[rows]}
        (loss, _), grad = part_fn(jnp.asarray(logp[rows]), part)
        loss, grad = float(loss), np.asarray(grad, np.float64)
        total += loss
        grads[rows] = grad
    np.testing.assert_allclose(total, full_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(grads, full_grad, rtol=1e-5, atol=1e-8)


def test_padding_rows_change_nothing():
    obj = make_objective("grpo")
    logp, batch = make_batch(4)
    batch = jax_batch(batch)
    rows = np.arange(9)  # drop the all-masked padding row
    loss, _, grad = _jax_loss_and_grad(obj, logp, batch)
    loss_np, _, grad_np = _jax_loss_and_grad(
        obj, logp[rows], {k: v[rows] for k, v in batch.items()}
    )
    np.testing.assert_allclose(loss, loss_np, rtol=1e-6)
    np.testing.assert_allclose(grad[rows], grad_np, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("clip", [0.2, None])
def test_value_loss_matches_numpy(clip):
    obj = make_objective("ppo", value_clip=clip, gae_lambda=0.9)
    _, batch = make_batch(5)
    new_values = batch["_values_new"]
    b64 = as64(batch)
    ref_loss, ref_grad = ref_impl.value_loss(obj.config, new_values.astype(np.float64), b64)
    fn = jax.jit(jax.value_and_grad(obj.value_loss, has_aux=True))
    (loss, metrics), grad = fn(jnp.asarray(new_values), jax_batch(batch))
    np.testing.assert_allclose(float(loss), ref_loss, rtol=1e-4)
    np.testing.assert_allclose(
        np.asarray(grad), ref_grad, rtol=1e-4, atol=1e-6 * np.abs(ref_grad).max()
    )
    if clip is None:
        assert float(metrics["value_clip_frac"]) == 0.0
    else:
        assert 0.0 < float(metrics["value_clip_frac"]) < 1.0
