"""Masked reductions over token or sequence arrays: the statistics the objective logs and uses.

Weights are 0/1 masks (or any non-negative weights); empty selections give 0, never NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array


def masked_sum(x: Array, mask: Array) -> Array:
    """Σ mask·x over all axes."""
    return jnp.sum(jnp.where(mask > 0, x * mask, 0.0))


def masked_mean(x: Array, mask: Array) -> Array:
    """Weighted mean Σ mask·x / Σ mask, exact for fractional weights (a total of 0.3 divides by
    0.3, not by a floor like 1); 0 when the mask is empty (no NaN, in the gradient either)."""
    total = jnp.sum(mask)
    safe = jnp.where(total > 0, total, 1)
    return jnp.where(total > 0, masked_sum(x, mask) / safe, 0.0)


def masked_std(x: Array, mask: Array, ddof: int = 1) -> Array:
    """Standard deviation over the selected entries of a 0/1 mask; 0 when fewer than ddof+1."""
    n = jnp.sum(mask)
    mean = masked_mean(x, mask)
    sq = masked_sum(jnp.square(x - mean), mask)
    return jnp.where(n > ddof, jnp.sqrt(sq / jnp.maximum(n - ddof, 1.0)), 0.0)


def masked_min(x: Array, mask: Array) -> Array:
    """Minimum over the selected entries; 0 when none is selected."""
    sel = mask > 0
    return jnp.where(jnp.any(sel), jnp.min(jnp.where(sel, x, jnp.inf)), 0.0)


def masked_max(x: Array, mask: Array) -> Array:
    """Maximum over the selected entries; 0 when none is selected."""
    sel = mask > 0
    return jnp.where(jnp.any(sel), jnp.max(jnp.where(sel, x, -jnp.inf)), 0.0)


def masked_quantile(x: Array, mask: Array, q: float) -> Array:
    """Quantile ``q`` (linear interpolation) over the selected entries; 0 when none."""
    sel = mask > 0
    value = jnp.nanquantile(jnp.where(sel, x, jnp.nan).ravel(), q)
    return jnp.where(jnp.any(sel), value, 0.0)
