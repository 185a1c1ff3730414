"""A preallocated key/value cache for incremental decoding, as a pytree of fixed-shape arrays.

Each batch row (a sampler slot) owns ``max_len`` cache entries. Entries carry their token position
and a validity bit, so attention needs no notion of "cache length": a row is reset by clearing its
validity, and right padding inside a prefill bucket is simply invalid until overwritten.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlax_tasks.models.config import ModelConfig


class KVCache(NamedTuple):
    """k, v: [layers, B, S, kv_heads, head_dim]; positions [B, S] int32; valid [B, S] bool."""

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    valid: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> KVCache:
    """An empty cache (every entry invalid) for ``batch`` rows of ``max_len`` tokens."""
    shape = (config.num_hidden_layers, batch, max_len, config.num_key_value_heads, config.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        positions=jnp.zeros((batch, max_len), jnp.int32),
        valid=jnp.zeros((batch, max_len), bool),
    )


def write_rows(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Writes new [B, T, ...] into buffer [B, S, ...] at per-row offsets start [B] along axis 1."""

    def one(row: jax.Array, values: jax.Array, offset: jax.Array) -> jax.Array:
        index = (offset,) + (0,) * (row.ndim - 1)
        return jax.lax.dynamic_update_slice(row, values.astype(row.dtype), index)

    return jax.vmap(one)(buffer, new, start)
