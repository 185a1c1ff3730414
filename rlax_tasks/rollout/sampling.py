"""Token sampling from logits with per-row temperature, top-k and top-p, and its log-probabilities.

Pure and jittable: every knob is a per-row array, so one compiled program serves a batch of slots
whose requests asked for different settings. Randomness comes from one key per row, so a row's
draw never depends on which other rows share the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Sets logits outside each row's top-k / top-p (nucleus) set to -inf.

    logits [B, V] float32; top_k [B] int (0 = off); top_p [B] float (1.0 = off). Ties at the
    threshold are all kept. The most likely token always survives.
    """
    vocab = logits.shape[-1]
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(ordered, (k - 1)[:, None], axis=-1)
    probs = jax.nn.softmax(ordered, axis=-1)
    # a token is in the nucleus when the mass strictly before it is below top_p
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    in_nucleus = mass_before < top_p[:, None]
    in_nucleus = in_nucleus.at[:, 0].set(True)
    nucleus_min = jnp.min(jnp.where(in_nucleus, ordered, jnp.inf), axis=-1, keepdims=True)
    threshold = jnp.maximum(kth, nucleus_min)
    return jnp.where(logits >= threshold, logits, _NEG_INF)


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    filtering: bool,
    sampling: bool = True,
) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row; returns (tokens [B] int32, log-probs [B] float32).

    Rows with temperature <= 0 are greedy. The log-prob is that of the drawn token under the
    distribution it was drawn from: softmax(logits / temperature) restricted to the top-k/top-p
    set; for greedy rows, the model's own distribution softmax(logits). ``filtering`` and
    ``sampling`` are static: False skips the vocabulary sort when no row uses top-k/top-p, and
    the draw when every row is greedy.
    """
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    if not sampling:  # every row is greedy: no draw at all
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    if filtering:
        scaled = filter_logits(scaled, top_k, top_p)
    drawn = inverse_cdf_draw(keys, scaled)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), drawn).astype(jnp.int32)
    logprobs = jax.nn.log_softmax(jnp.where(greedy[:, None], logits, scaled), axis=-1)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def inverse_cdf_draw(keys: jax.Array, logits: jax.Array) -> jax.Array:
    """One exact draw per row from softmax(logits) by inverting its CDF with one uniform.

    One random number per row instead of a Gumbel per vocabulary entry (that costs more than the
    decode step itself on CPU for a 32k vocabulary). Entries at -inf have probability 0 and are
    never drawn.
    """
    cdf = jnp.cumsum(jax.nn.softmax(logits, axis=-1), axis=-1)
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys) * cdf[:, -1]
    index = jnp.sum(cdf <= u[:, None], axis=-1)
    return jnp.minimum(index, logits.shape[-1] - 1)


def token_key(seed_key: jax.Array, index: jax.Array) -> jax.Array:
    """The key for the index-th generated token of a request: fold_in(request key, index)."""
    return jax.random.fold_in(seed_key, index)
