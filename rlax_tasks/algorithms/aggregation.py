"""Token weights (Agg slot of DESIGN §4): how per-token terms are summed into one loss.

B counts the valid rows (at least one completion token). For a micro-batch of a larger batch,
pass the full batch's ``num_sequences`` / ``num_tokens`` so micro-batch losses add up exactly.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import Array


def token_weights(
    mask: Array,
    mode: str,
    *,
    max_length: int | None = None,
    num_sequences: Array | float | None = None,
    num_tokens: Array | float | None = None,
) -> Array:
    """Weights [B, T] (0 off the mask) for ``mode`` in individual / group / max_length / sequence.

    individual: 1/(B·|o_b|) (GRPO); group: 1/Σ_b|o_b| (token mean, DAPO); max_length:
    1/(B·L_max) with L_max = ``max_length`` or the width T (Dr. GRPO); sequence: 1/B (token sum
    per sequence, mean over sequences).
    """
    mask = mask.astype(jnp.float32)
    lengths = jnp.sum(mask, axis=1)
    if num_sequences is None:
        num_sequences = jnp.sum(lengths > 0)
    if num_tokens is None:
        num_tokens = jnp.sum(lengths)
    b = jnp.maximum(jnp.asarray(num_sequences, jnp.float32), 1.0)
    if mode == "individual":
        per_row = 1.0 / (b * jnp.maximum(lengths, 1.0))
        return mask * per_row[:, None]
    if mode == "group":
        return mask / jnp.maximum(jnp.asarray(num_tokens, jnp.float32), 1.0)
    if mode == "max_length":
        return mask / (b * float(max_length or mask.shape[1]))
    if mode == "sequence":
        return mask / b
    raise ValueError(f"agg={mode!r} is not valid; choose individual, group, max_length, sequence")
