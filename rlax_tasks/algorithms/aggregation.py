"""Token weights (Agg slot of docs/design.md §4): how per-token terms are summed into one loss.

B counts the valid rows (at least one completion token). For a micro-batch of a larger batch,
pass the full batch's ``num_sequences`` / ``num_tokens`` so micro-batch losses add up exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax.numpy as jnp
from jax import Array

from rlax_tasks.algorithms import names


class Counts(NamedTuple):
    """What the Agg modes divide by: per-row lengths [B], B and Σ_b|o_b| (full batch), L_max."""

    lengths: Array
    num_sequences: Array
    num_tokens: Array
    max_length: int


def individual(mask: Array, n: Counts) -> Array:
    """1/(B·|o_b|) (GRPO: token mean per sequence, mean over sequences)."""
    return mask * (1.0 / (n.num_sequences * jnp.maximum(n.lengths, 1.0)))[:, None]


def group(mask: Array, n: Counts) -> Array:
    """1/Σ_b|o_b| (token mean over the batch, DAPO)."""
    return mask / jnp.maximum(n.num_tokens, 1.0)


def max_length(mask: Array, n: Counts) -> Array:
    """1/(B·L_max) (Dr. GRPO)."""
    return mask / (n.num_sequences * float(n.max_length))


def sequence(mask: Array, n: Counts) -> Array:
    """1/B (token sum per sequence, mean over sequences)."""
    return mask / n.num_sequences


AGG: dict[str, Callable[[Array, Counts], Array]] = {
    "individual": individual,
    "group": group,
    "max_length": max_length,
    "sequence": sequence,
}
names.check_table(AGG, names.AGG_MODES, "aggregation")


def token_weights(
    mask: Array,
    mode: str,
    *,
    max_length: int | None = None,
    num_sequences: Array | float | None = None,
    num_tokens: Array | float | None = None,
) -> Array:
    """Weights [B, T] (0 off the mask) of Agg ``mode``; L_max = ``max_length`` or the width T."""
    mask = mask.astype(jnp.float32)
    lengths = jnp.sum(mask, axis=1)
    if num_sequences is None:
        num_sequences = jnp.sum(lengths > 0)
    if num_tokens is None:
        num_tokens = jnp.sum(lengths)
    counts = Counts(
        lengths,
        jnp.maximum(jnp.asarray(num_sequences, jnp.float32), 1.0),
        jnp.asarray(num_tokens, jnp.float32),
        max_length or mask.shape[1],
    )
    return AGG[mode](mask, counts)
