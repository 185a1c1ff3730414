"""A preallocated key/value cache for incremental decoding: a pytree of fixed-shape arrays.

Each row (a sampler slot) owns ``max_len`` entries carrying their position and a validity bit, so
a row resets by clearing validity. Each layer's keys and values are arrays of their own, keys
[B, kv_heads, head_dim, S] and values [B, kv_heads, S, head_dim]: decode's two products read them
as matmul operands, where a slice of an all-layer array would be copied first at every step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from rlax_tasks.models.config import ModelConfig
from rlax_tasks.models.sharding import BATCH, AxisSpec, constrain, fit_spec

# mesh axes of each cache array (a layer's k and v): slots over the data-parallel axes, kv heads
# over "tensor" (the layout of the attention's k/v activations, so a decode step never moves the
# cache)
CACHE_AXES: dict[str, tuple[AxisSpec, ...]] = {
    "k": (BATCH, "tensor", None, None),
    "v": (BATCH, "tensor", None, None),
    "positions": (BATCH, None),
    "valid": (BATCH, None),
}


class KVCache(NamedTuple):
    """k: per layer [B, kv_heads, head_dim, S] (transposed keys); v: per layer [B, kv_heads, S,
    head_dim]; positions [B, S] int32; valid [B, S] bool."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    positions: jax.Array
    valid: jax.Array

    @property
    def max_len(self) -> int:
        return self.positions.shape[-1]

    @property
    def dtype(self) -> jnp.dtype:
        return self.k[0].dtype


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype) -> KVCache:
    """An empty cache (every entry invalid) for ``batch`` rows of ``max_len`` tokens."""
    layers, kv, hd = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
    return KVCache(
        k=tuple(jnp.zeros((batch, kv, hd, max_len), dtype) for _ in range(layers)),
        v=tuple(jnp.zeros((batch, kv, max_len, hd), dtype) for _ in range(layers)),
        positions=jnp.zeros((batch, max_len), jnp.int32),
        valid=jnp.zeros((batch, max_len), bool),
    )


def _per_array(cache: KVCache, fn: Callable[[str, Any], Any]) -> KVCache:
    """``fn(name, array)`` applied to every array of ``cache`` (each layer's k and v)."""
    return KVCache(
        k=tuple(fn("k", x) for x in cache.k),
        v=tuple(fn("v", x) for x in cache.v),
        positions=fn("positions", cache.positions),
        valid=fn("valid", cache.valid),
    )


def cache_shardings(cache: KVCache, mesh: jax.sharding.Mesh) -> KVCache:
    """NamedShardings laying ``cache`` out over ``mesh`` (axes that do not divide: replicated)."""
    shape = dict(mesh.shape)

    def place(name: str, x: jax.Array) -> jax.sharding.NamedSharding:
        return jax.sharding.NamedSharding(mesh, fit_spec(x.shape, CACHE_AXES[name], shape))

    return _per_array(cache, place)


def constrain_cache(cache: KVCache) -> KVCache:
    """The cache pinned to its layout on the active mesh (a no-op without one)."""
    return _per_array(cache, lambda name, x: constrain(x, *CACHE_AXES[name]))


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
