"""The time a model's matrix products alone take for a rollout: a floor under any decode loop.

``rollout.py`` times it beside ours and transformers ``generate``: the prefill's products for
B x P prompt tokens (the output projection for each row's last token only), then N - 1 decode
steps of B tokens through every layer's q/k/v/o and gate/up/down products and the output
projection, on the policy's own weights (each layer's arrays of their own, as the sampler holds
them). Attention, norms, RoPE, the cache and sampling are left out, so no implementation whose
products run at XLA:CPU's speed can take less; transformers' time over this floor is the most any
of them could beat it by.
"""

from __future__ import annotations

from collections.abc import Callable
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


def _layer(x: jax.Array, m: dict[str, jax.Array]) -> jax.Array:
    q, k, v = x @ m["q_proj"], x @ m["k_proj"], x @ m["v_proj"]
    # q stands in for the attention output (its shape); k and v feed it so neither is dropped
    attended = q + (jnp.sum(k, -1, keepdims=True) + jnp.sum(v, -1, keepdims=True)) * 1e-6
    x = x + attended @ m["o_proj"]
    return x + (jax.nn.silu(x @ m["gate_proj"]) * (x @ m["up_proj"])) @ m["down_proj"]


def floor_program(policy: Any, batch: int, prompt_len: int, new_tokens: int) -> tuple:
    """(the jitted products, their arguments): ``fn(*args)`` runs a rollout's products once."""
    mats, head = layer_matrices(policy)
    d = policy.config.hidden_size

    def products(prompt: jax.Array, mats: list, head: jax.Array) -> jax.Array:
        h = prompt
        for m in mats:
            h = _layer(h, m)
        last = h.reshape(batch, prompt_len, d)[:, -1]
        # the maximum of every row's logits: the product is needed whole
        x = last + jnp.max(last @ head, -1, keepdims=True) * 1e-6

        def step(_: int, x: jax.Array) -> jax.Array:
            for m in mats:
                x = _layer(x, m)
            return x + jnp.max(x @ head, -1, keepdims=True) * 1e-6

        return jax.lax.fori_loop(0, new_tokens - 1, step, x)

    prompt = jnp.full((batch * prompt_len, d), 0.01, jnp.float32)
    return jax.jit(products), (prompt, mats, head)


def make_floor(policy: Any, batch: int, prompt_len: int, new_tokens: int) -> Callable[[], Any]:
    """A no-argument callable running the rollout's products once (blocking); compiled on its
    first call."""
    fn, args = floor_program(policy, batch, prompt_len, new_tokens)
    return lambda: jax.block_until_ready(fn(*args))
