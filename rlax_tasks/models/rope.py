"""Rotary position embeddings with HF-compatible frequency schedules (default, linear, llama3)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from rlax_tasks.models.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """The [head_dim/2] inverse frequencies, computed in float32 exactly as transformers does."""
    dim = config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions: jnp.ndarray, inv_freq: np.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """cos/sin tables [B, T, head_dim] in float32 for integer positions [B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jnp.ndarray, cos: jnp.ndarray, sin: jnp.ndarray) -> jnp.ndarray:
    """Rotates x [B, T, heads, head_dim] by the (rotate-half convention) tables [B, T, head_dim]."""
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
