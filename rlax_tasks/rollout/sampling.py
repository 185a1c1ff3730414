"""Token sampling from logits with per-row temperature, top-k and top-p, and its log-probabilities.

Pure and jittable: every knob is a per-row array, so one compiled program serves a batch of slots
whose requests asked for different settings. One key per row: a row's draw never depends on
which other rows share the batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf
# tokens per block of the two-level CDF inversion (see inverse_cdf_draw)
DRAW_BLOCK = 256


def filter_logits(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Sets logits outside each row's top-k / top-p (nucleus) set to -inf.

    logits [B, V] float32; top_k [B] int (0 = off); top_p [B] float (1.0 = off). Ties at the
    threshold are all kept; the most likely token always survives. Both thresholds are found
    exactly by bisection over the logits' 2^32 orderable bit patterns: no vocabulary sort."""
    vocab = logits.shape[-1]
    keys = _order_keys(logits)
    probs = jax.nn.softmax(logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    top = jnp.max(keys, axis=-1, keepdims=True)

    def bisect(_: int, bounds: tuple) -> tuple:
        # [k_lo, k_hi]: the k-th largest key is the largest t with count(keys >= t) >= k;
        # [p_lo, p_hi]: the nucleus' smallest key is the smallest t whose mass above is < top_p
        k_lo, k_hi, p_lo, p_hi = bounds
        k_mid = k_lo + ((k_hi - k_lo) >> 1) + ((k_hi - k_lo) & 1)
        enough = jnp.sum(keys >= k_mid, axis=-1, keepdims=True) >= k
        k_lo, k_hi = jnp.where(enough, k_mid, k_lo), jnp.where(enough, k_hi, k_mid - 1)
        p_mid = p_lo + ((p_hi - p_lo) >> 1)
        above = jnp.sum(jnp.where(keys > p_mid, probs, 0.0), axis=-1, keepdims=True)
        inside = above < top_p[:, None]
        p_lo, p_hi = jnp.where(inside, p_lo, p_mid + 1), jnp.where(inside, p_mid, p_hi)
        return k_lo, k_hi, p_lo, p_hi

    zero = jnp.zeros_like(top)
    kth, _, nucleus_min, _ = jax.lax.fori_loop(0, 32, bisect, (zero, top, zero, top))
    nucleus_min = jnp.where(top_p[:, None] >= 1.0, zero, nucleus_min)  # off: every token
    return jnp.where(keys >= jnp.maximum(kth, nucleus_min), logits, _NEG_INF)


def _order_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (-0.0 and 0.0 equal): a float's bits with the
    sign bit set when positive, all bits flipped when negative."""
    x = x.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(jnp.where(x == 0, 0.0, x), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    filtering: bool,
    sampling: bool = True,
    support_size: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draws one token per row; returns (tokens [B] int32, log-probs [B] float32, kept support
    [B, ``support_size``] int32).

    Rows with temperature <= 0 are greedy. The log-prob is the drawn token's under the distribution
    it was drawn from (the model's own for greedy rows). ``filtering`` and ``sampling`` are static:
    False skips the top-k/top-p filter when no row uses it, the draw when every row is greedy.
    ``support_size`` (static): the ids each row's top-k/top-p kept, for the trainer to take its
    log-probs over the same tokens (``kept_support``); -1 everywhere for a row that did not
    filter."""
    logits = logits.astype(jnp.float32)
    rows = logits.shape[0]
    greedy = temperature <= 0
    none = jnp.full((rows, support_size), -1, jnp.int32)
    if not sampling:  # every row is greedy: no draw at all
        tokens, best = _greedy(logits)
        # log softmax at the maximum: -log(sum(exp(logits - max))), one pass over the row
        return tokens, -jnp.log(jnp.sum(jnp.exp(logits - best[:, None]), axis=-1)), none
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    support = none
    if filtering:
        scaled = filter_logits(scaled, top_k, top_p)
        if support_size:
            filters = ~greedy & ((top_k > 0) | (top_p < 1.0))
            support = jnp.where(filters[:, None], kept_support(scaled, support_size), -1)
    drawn = inverse_cdf_draw(keys, scaled)
    tokens = jnp.where(greedy, greedy_tokens(logits), drawn).astype(jnp.int32)
    return tokens, _logprobs_at(jnp.where(greedy[:, None], logits, scaled), tokens), support


def kept_support(filtered: jax.Array, size: int) -> jax.Array:
    """The ids of each row's tokens that ``filter_logits`` kept (finite), in id order, -1
    padded to ``size`` [B, size] int32; a row that kept more than ``size`` tokens gets -1
    everywhere (it cannot be replayed: the trainer keeps the whole vocabulary there). One pass
    over the row (a running count places each kept id), no top-k sort."""
    kept = filtered > _NEG_INF
    slot = jnp.cumsum(kept, axis=-1, dtype=jnp.int32) - 1  # where each kept id goes
    slot = jnp.where(kept & (slot < size), slot, size)  # the rest: one past the end, dropped
    rows, vocab = filtered.shape
    ids = jnp.broadcast_to(jnp.arange(vocab, dtype=jnp.int32), (rows, vocab))
    out = jnp.full((rows, size), -1, jnp.int32)
    out = out.at[jnp.arange(rows)[:, None], slot].set(ids, mode="drop")
    fits = jnp.sum(kept, axis=-1) <= size
    return jnp.where(fits[:, None], out, -1)


def _logprobs_at(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """log softmax(logits)[b, tokens[b]] [B], without writing the [B, V] log-softmax out."""
    top = jnp.max(logits, axis=-1)
    lse = top + jnp.log(jnp.sum(jnp.exp(logits - top[:, None]), axis=-1))
    return jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """Each row's most likely token [B] int32, the first of ties (as ``argmax``); a row with
    no maximum (NaNs) gets its last token."""
    return _greedy(logits)[0]


def _greedy(logits: jax.Array, block: int = DRAW_BLOCK // 2) -> tuple[jax.Array, jax.Array]:
    """(``greedy_tokens``, each row's maximum [B]).

    Found in two levels, as ``inverse_cdf_draw`` draws: each ``block``'s maximum, then the first
    block holding the row's maximum, then the first index in it. XLA:CPU runs ``argmax``'s paired
    value-index reduction unvectorised; a whole-row first-index reduction costs far more."""
    rows, vocab = logits.shape
    block = min(block, vocab)
    blocks = -(-vocab // block)
    padded = jnp.pad(logits, ((0, 0), (0, blocks * block - vocab)), constant_values=_NEG_INF)
    padded = padded.reshape(rows, blocks, block)
    block_max = jnp.max(padded, axis=-1)  # [B, blocks]
    best = jnp.max(block_max, axis=-1)
    holds = block_max == best[:, None]
    j = jnp.argmax(holds, axis=-1)  # the first block holding the maximum
    within = jnp.take_along_axis(padded, j[:, None, None], axis=1)[:, 0]  # [B, block]
    index = j * block + jnp.argmax(within == best[:, None], axis=-1)
    # a row of NaNs has no maximum: its last token
    index = jnp.where(jnp.any(holds, axis=-1), index, vocab - 1)
    return index.astype(jnp.int32), best


def inverse_cdf_draw(keys: jax.Array, logits: jax.Array, block: int = DRAW_BLOCK) -> jax.Array:
    """One exact draw per row from softmax(logits) by inverting its CDF with one uniform.

    One random number per row, not a Gumbel per vocabulary entry (dearer than a decode step on CPU).
    The CDF is inverted in two levels (block sums find the block, its running sum the token): no
    cumulative sum over the vocabulary (a long serial scan on TPU). -inf is never drawn."""
    rows, vocab = logits.shape
    block = _dividing_block(vocab, block)
    blocks = -(-vocab // block)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.pad(probs, ((0, 0), (0, blocks * block - vocab))).reshape(rows, blocks, block)
    totals = jnp.sum(probs, axis=-1)  # [B, blocks]
    ends = jnp.cumsum(totals, axis=-1)  # the CDF at each block's end
    u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys) * ends[:, -1]
    # the block holding u (rounding may put u at the very end: the last block with mass)
    j = jnp.minimum(jnp.sum(ends <= u[:, None], axis=-1), _last_positive(totals))
    before = jnp.where(
        j > 0, jnp.take_along_axis(ends, jnp.maximum(j - 1, 0)[:, None], -1)[:, 0], 0
    )
    mass = jnp.take_along_axis(probs, j[:, None, None], axis=1)[:, 0]  # [B, block]
    count = jnp.sum(before[:, None] + jnp.cumsum(mass, axis=-1) <= u[:, None], axis=-1)
    # rounding may leave u past the block's own sum: its last token of non-zero probability
    return (j * block + jnp.minimum(count, _last_positive(mass))).astype(jnp.int32)


def _dividing_block(vocab: int, block: int) -> int:
    """``block``, or the largest power of two below it down to a quarter of it that divides
    ``vocab``: blocks that tile the row need no padded copy of it (Qwen's 151936 = 1187 x 128)."""
    if vocab <= block:
        return vocab
    size = block
    while size >= max(1, block // 4):
        if vocab % size == 0:
            return size
        size //= 2
    return block


def _last_positive(x: jax.Array) -> jax.Array:
    """The index of each row's last positive entry along the last axis (0 when none is)."""
    return jnp.max(jnp.where(x > 0, jnp.arange(x.shape[-1]), 0), axis=-1)


def token_key(seed_key: jax.Array, index: jax.Array) -> jax.Array:
    """The key for the index-th generated token of a request: fold_in(request key, index)."""
    return jax.random.fold_in(seed_key, index)
