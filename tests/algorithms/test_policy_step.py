"""The objective on the log-probs of a small differentiable policy (a bigram softmax model,
aligned like models.forward.token_logprobs): one gradient step moves
probability towards positive-advantage completions and away from negative ones."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tasks.algorithms import make_objective

VOCAB = 16


def token_logprobs(table: jax.Array, ids: jax.Array) -> jax.Array:
    """log p(ids[t] | ids[t-1]) as [B, T], 0 at t=0 (the token_logprobs alignment)."""
    logits = table[ids[:, :-1]]
    lp = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), ids[:, 1:, None], -1)[..., 0]
    return jnp.concatenate([jnp.zeros_like(lp[:, :1]), lp], axis=1)


@pytest.mark.parametrize("name", ["grpo", "dapo", "rloo", "cispo", "gspo"])
def test_one_step_moves_probability_towards_positive_advantages(name):
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(0, 0.1, (VOCAB, VOCAB)), jnp.float32)
    prompt = np.array([1, 2, 3])
    # completions use disjoint token sets so their gradients do not interfere
    comps = [np.array([4, 5, 6]), np.array([7, 8, 9]), np.array([10, 11, 12]), [13, 14, 15]]
    ids = jnp.asarray(np.stack([np.concatenate([prompt, c]) for c in comps]), jnp.int32)
    mask = np.zeros(ids.shape, np.float32)
    mask[:, 3:] = 1.0
    old = token_logprobs(table, ids)
    batch = {
        "old_logprobs": old,
        "ref_logprobs": old,
        "mask": mask,
        "rewards": jnp.array([1.0, 0.0, 0.0, 1.0]),
        "group_ids": jnp.array([5, 5, 5, 5]),
    }
    obj = make_objective(name)

    @jax.jit
    def loss_fn(t):
        return obj.loss(token_logprobs(t, ids), batch)

    (loss0, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(table)
    assert float(metrics["clip_frac"]) == 0.0
    assert np.all(np.isfinite(grad)) and float(jnp.sum(grad**2)) > 0
    new_table = table - 0.5 * grad
    if obj.config.ratio_is == "none" and obj.config.policy_term != "gspo":
        # (CISPO's IS weights and GSPO's tiny clip range change with the step: not comparable)
        loss1, _ = loss_fn(new_table)
        assert float(loss1) < float(loss0)
    delta = np.asarray(jnp.sum((token_logprobs(new_table, ids) - old) * mask, axis=1))
    assert delta[0] > 0 and delta[3] > 0 and delta[1] < 0 and delta[2] < 0
