"""The one masked mean (``algorithms.masked``, which the train step's metrics use too): a weighted
mean for fractional masks, 0 for an empty one, with a finite gradient either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rlax_tasks.algorithms import masked
from rlax_tasks.trainer import train_step

X = jnp.asarray([[2.0, 4.0, 10.0], [7.0, -1.0, 3.0]])


def test_a_fractional_mask_divides_by_its_own_total() -> None:
    """Weights summing to 0.3: (0.1·2 + 0.2·4) / 0.3 = 10/3, not that sum over a floor of 1."""
    mask = jnp.asarray([[0.1, 0.2, 0.0], [0.0, 0.0, 0.0]])
    np.testing.assert_allclose(float(masked.masked_mean(X, mask)), 10.0 / 3.0, rtol=1e-6)
    tiny = mask * 1e-6  # the same weights at any scale: the same mean
    np.testing.assert_allclose(float(masked.masked_mean(X, tiny)), 10.0 / 3.0, rtol=1e-5)


def test_a_zero_one_mask_is_the_plain_mean_of_the_selected_entries() -> None:
    mask = jnp.asarray([[1, 0, 1], [0, 1, 0]], jnp.float32)
    np.testing.assert_allclose(float(masked.masked_mean(X, mask)), (2.0 + 10.0 - 1.0) / 3)
    np.testing.assert_allclose(float(masked.masked_mean(X, mask > 0)), (2.0 + 10.0 - 1.0) / 3)


def test_an_empty_mask_gives_zero_and_a_finite_gradient() -> None:
    empty = jnp.zeros_like(X)
    nan_x = X.at[0, 0].set(jnp.nan)  # what masked positions hold must not leak
    assert float(masked.masked_mean(nan_x, empty)) == 0.0
    grad = jax.grad(lambda x: masked.masked_mean(x, empty))(X)
    assert np.all(np.asarray(grad) == 0.0)
    half = jnp.asarray([[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    grad = jax.grad(lambda x: masked.masked_mean(x, half))(X)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(half) / 0.5)


def test_the_train_step_reports_with_the_same_function() -> None:
    assert train_step.masked_mean is masked.masked_mean
    assert train_step.masked_quantile is masked.masked_quantile
