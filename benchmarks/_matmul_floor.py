"""The time a model's matrix products alone take for a rollout: a floor under any decode loop.
The prefill's products for B x P prompt tokens, then N - 1 decode steps through every layer's
projections and the output head, on the policy's own weights; attention, norms, RoPE, the cache
and sampling are left out. ``attention=True`` adds attention's two products over the KV cache's
window (per stretch of ``ATTENTION_STRETCHES`` steps), still without softmax, mask or writes."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

# each projection's module, and whether its output (not its input) is the hidden size
_KERNELS = {
    "q_proj": ("self_attn", False),
    "k_proj": ("self_attn", False),
    "v_proj": ("self_attn", False),
    "o_proj": ("self_attn", True),
    "gate_proj": ("mlp", False),
    "up_proj": ("mlp", False),
    "down_proj": ("mlp", True),
}


def layer_matrices(policy: Any) -> tuple[list[dict[str, jax.Array]], jax.Array]:
    """Each layer's projection kernels as [in, out] matrices (arrays of their own, as
    ``Transformer.unstack_layers`` gives them), and the [D, V] output projection."""
    model = nnx.merge(policy.graphdef, policy.params)
    d = policy.config.hidden_size

    def matrix(layer: nnx.State, name: str) -> jax.Array:
        module, to_hidden = _KERNELS[name]
        k = jnp.asarray(layer[module][name]["kernel"][...], jnp.float32)
        return k.reshape(-1, d) if to_hidden else k.reshape(d, -1)

    mats = [{name: matrix(layer, name) for name in _KERNELS} for layer in model.unstack_layers()]
    return mats, jnp.asarray(model.unembedding(), jnp.float32)


# the decode steps of the attention floor run in this many stretches, each over a fixed window
ATTENTION_STRETCHES = 8


def stretches(prompt_len: int, new_tokens: int) -> list[tuple[int, int]]:
    """(decode steps, cache entries attended) of each stretch of the N - 1 decode steps: decode
    step t (from 0) feeds the token at position P + t, so the cache then holds P + t + 1
    entries; a stretch attends over what its first step holds."""
    steps = new_tokens - 1
    starts = sorted({steps * j // ATTENTION_STRETCHES for j in range(ATTENTION_STRETCHES)})
    bounds = [t for t in starts if t < steps] + [steps]
    return [(end - start, prompt_len + start + 1) for start, end in pairwise(bounds)]


def _attend(q: jax.Array, keys: jax.Array, values: jax.Array) -> jax.Array:
    """Attention's two products for queries [B, H * hd] over keys [B, KV, hd, W] and values
    [B, KV, W, hd] (the sampler's cache layout): [B, H * hd]."""
    b, kv, hd = keys.shape[0], keys.shape[1], keys.shape[2]
    rows = q.reshape(b, kv, -1, hd)  # each kv head's query heads, as the sampler groups them
    scores = jnp.einsum("bkgd,bkdw->bkgw", rows, keys)
    return jnp.einsum("bkgw,bkwd->bkgd", scores, values).reshape(b, -1)


def _layer(
    x: jax.Array, m: dict[str, jax.Array], window: tuple[jax.Array, jax.Array] | None = None
) -> jax.Array:
    """One layer's products; with ``window`` (keys, values), attention's two over it too."""
    q, k, v = x @ m["q_proj"], x @ m["k_proj"], x @ m["v_proj"]
    # without a window q stands in for the attention output (its shape); k and v feed it so
    # neither product is dropped (a cache write would use them)
    attended = q if window is None else _attend(q, *window)
    attended = attended + (jnp.sum(k, -1, keepdims=True) + jnp.sum(v, -1, keepdims=True)) * 1e-6
    x = x + attended @ m["o_proj"]
    return x + (jax.nn.silu(x @ m["gate_proj"]) * (x @ m["up_proj"])) @ m["down_proj"]


def cache_windows(policy: Any, batch: int, prompt_len: int, new_tokens: int) -> list:
    """Each stretch's (keys, values): per layer, arrays [B, KV, hd, W] and [B, KV, W, hd]."""
    c = policy.config
    kv, hd, layers = c.num_key_value_heads, c.head_dim, c.num_hidden_layers
    return [
        (
            tuple(jnp.full((batch, kv, hd, w), 0.01, jnp.float32) for _ in range(layers)),
            tuple(jnp.full((batch, kv, w, hd), 0.01, jnp.float32) for _ in range(layers)),
        )
        for _, w in stretches(prompt_len, new_tokens)
    ]


def floor_program(
    policy: Any, batch: int, prompt_len: int, new_tokens: int, attention: bool = False
) -> tuple:
    """(the jitted products, their arguments): ``fn(*args)`` runs a rollout's products once;
    with ``attention``, attention's products over the cache too (the last argument: the
    windows, ``cache_windows``)."""
    mats, head = layer_matrices(policy)
    d = policy.config.hidden_size
    plan = stretches(prompt_len, new_tokens)

    def products(prompt: jax.Array, mats: list, head: jax.Array, windows: Any) -> jax.Array:
        h = prompt
        for m in mats:
            h = _layer(h, m)
        last = h.reshape(batch, prompt_len, d)[:, -1]
        # the maximum of every row's logits: the product is needed whole
        x = last + jnp.max(last @ head, -1, keepdims=True) * 1e-6

        def step(x: jax.Array, layer_windows: list) -> jax.Array:
            for m, window in zip(mats, layer_windows, strict=True):
                x = _layer(x, m, window)
            return x + jnp.max(x @ head, -1, keepdims=True) * 1e-6

        if windows is None:
            no_windows = [None] * len(mats)
            return jax.lax.fori_loop(0, new_tokens - 1, lambda _, x: step(x, no_windows), x)
        for (steps, _), (keys, values) in zip(plan, windows, strict=True):
            layer_windows = list(zip(keys, values, strict=True))
            x = jax.lax.fori_loop(0, steps, lambda _, x, w=layer_windows: step(x, w), x)
        return x

    prompt = jnp.full((batch * prompt_len, d), 0.01, jnp.float32)
    if not attention:
        return jax.jit(lambda p, m, h: products(p, m, h, None)), (prompt, mats, head)
    windows = cache_windows(policy, batch, prompt_len, new_tokens)
    return jax.jit(products), (prompt, mats, head, windows)


def make_floor(
    policy: Any, batch: int, prompt_len: int, new_tokens: int, attention: bool = False
) -> Callable[[], Any]:
    """A no-argument callable running the rollout's products once (blocking); compiled on its
    first call."""
    fn, args = floor_program(policy, batch, prompt_len, new_tokens, attention)
    return lambda: jax.block_until_ready(fn(*args))
