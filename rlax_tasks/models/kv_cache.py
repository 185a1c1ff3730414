"""A preallocated key/value cache for incremental decoding: a pytree of fixed-shape arrays.

Each row (a sampler slot) owns ``max_len`` entries carrying their position and a validity bit, so
a row resets by clearing validity. Keys are stored [.., kv_heads, head_dim, S] and values
[.., kv_heads, S, head_dim]: decode's two products read them as matmul operands, without copies."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from rlax_tasks.models.config import ModelConfig
from rlax_tasks.models.sharding import BATCH, AxisSpec, constrain, fit_spec

# mesh axes of each cache array: slots over the data-parallel axes, kv heads over "tensor" (the
# layout of the attention's k/v activations, so a decode step never moves the cache)
CACHE_AXES: dict[str, tuple[AxisSpec, ...]] = {
    "k": (None, BATCH, "tensor", None, None),
    "v": (None, BATCH, "tensor", None, None),
    "positions": (BATCH, None),
    "valid": (BATCH, None),
}


class KVCache(NamedTuple):
    """k: [layers, B, kv_heads, head_dim, S] (transposed keys); v: [layers, B, kv_heads, S,
    head_dim]; positions [B, S] int32; valid [B, S] bool."""

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    valid: jax.Array

    @property
    def max_len(self) -> int:
        return self.k.shape[-1]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> KVCache:
    """An empty cache (every entry invalid) for ``batch`` rows of ``max_len`` tokens."""
    layers, kv, hd = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    return KVCache(
        k=jnp.zeros((layers, batch, kv, hd, max_len), dtype),
        v=jnp.zeros((layers, batch, kv, max_len, hd), dtype),
        positions=jnp.zeros((batch, max_len), jnp.int32),
        valid=jnp.zeros((batch, max_len), bool),
    )


def cache_shardings(cache: KVCache, mesh: jax.sharding.Mesh) -> KVCache:
    """NamedShardings laying ``cache`` out over ``mesh`` (axes that do not divide: replicated)."""
    shape = dict(mesh.shape)
    return KVCache(
        *(
            jax.sharding.NamedSharding(mesh, fit_spec(x.shape, CACHE_AXES[name], shape))
            for name, x in zip(KVCache._fields, cache, strict=True)
        )
    )


def constrain_cache(cache: KVCache) -> KVCache:
    """The cache pinned to its layout on the active mesh (a no-op without one)."""
    return KVCache(
        *(constrain(x, *CACHE_AXES[name]) for name, x in zip(KVCache._fields, cache, strict=True))
    )


def write_rows(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """Writes new [B, T, ...] into buffer [B, S, ...] at per-row offsets start [B] along axis 1."""

    def one(row: jax.Array, values: jax.Array, offset: jax.Array) -> jax.Array:
        index = (offset,) + (0,) * (row.ndim - 1)
        return jax.lax.dynamic_update_slice(row, values.astype(row.dtype), index)

    return jax.vmap(one)(buffer, new, start)


def keys_to_cache(k: jax.Array) -> jax.Array:
    """Keys [B, T, kv_heads, head_dim] (the activations' layout) in the cache's [B, kv_heads,
    head_dim, T]."""
    return k.transpose(0, 2, 3, 1)


def values_to_cache(v: jax.Array) -> jax.Array:
    """Values [B, T, kv_heads, head_dim] in the cache's [B, kv_heads, T, head_dim]."""
    return v.transpose(0, 2, 1, 3)
