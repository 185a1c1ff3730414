"""Pure forward functions over (graphdef, params): logits and chunked per-token log-probabilities.

These are what the trainer, the sampler and the tests jit; ``Policy`` is a thin stateful wrapper.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from rlax_tasks.models.kv_cache import KVCache
from rlax_tasks.models.logprob_options import DEFAULT_LOGPROBS, LogProbOptions
from rlax_tasks.models.sharding import BATCH, constrain


def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Token positions [B, T] that skip padding: 0 at the first real token (left padding works)."""
    return jnp.maximum(jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1, 0)


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Token positions [B, T] of sequences packed into rows: 0 at each segment's first token
    (a segment is a run of equal ids; ``segment_ids`` 0 marks padding)."""
    t = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1
    )
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


def model_inputs(
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(ids, positions, valid) for the model: ``valid`` is the bool mask, or with
    ``segment_ids`` (packed sequences, 0 on padding; the mask is then unused) the int ids."""
    input_ids = jnp.asarray(input_ids, jnp.int32)
    if segment_ids is not None:
        segments = jnp.asarray(segment_ids, jnp.int32)
        return input_ids, positions_from_segments(segments), segments
    if attention_mask is None:
        attention_mask = jnp.ones_like(input_ids)
    valid = jnp.asarray(attention_mask).astype(bool)
    return input_ids, positions_from_mask(valid), valid


def logits(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
) -> jax.Array:
    """Float32 logits [B, T, V]; rows at padding positions are meaningless."""
    model = nnx.merge(graphdef, params)
    ids, positions, valid = model_inputs(input_ids, attention_mask)
    return model(ids, positions, valid)


def token_logprobs(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    options: LogProbOptions = DEFAULT_LOGPROBS,
    *,
    segment_ids: jax.Array | None = None,
    support: jax.Array | None = None,
    routes: jax.Array | None = None,
    with_entropy: bool = False,
    with_route_stats: bool = False,
) -> jax.Array | tuple[jax.Array, ...]:
    """log p(ids[t] | ids[<t]) per token, chunk by chunk, never all [B, T, V] logits at once
    (unless they fit ``options.keep_logits_bytes``).

    Args:
        graphdef: the model's graph (``Policy.graphdef``).
        params: its parameters.
        input_ids: int token ids [B, T].
        attention_mask: [B, T], 1 on real tokens (None: all real; unused with ``segment_ids``).
        options: the pass's static settings (chunk size, remat, temperature, ...).
        segment_ids: [B, T] int, sequences packed into rows (0: padding); a segment's first
            token then gets a meaningless value (predicted from the previous segment).
        support: [B, T, R] int, the ids a sampler's top-k/top-p kept for token t (-1: none);
            the distribution is renormalised over them.
        routes: [B, T, L, k] int, a mixture-of-experts model's recorded experts (-1: none).
        with_entropy: also return the predictive entropy.
        with_route_stats: also return the layers' ``moe.RouteStats`` (None: a dense model).

    Returns:
        The log-probs [B, T] (0 at t=0); with ``with_entropy`` and ``with_route_stats`` a tuple
        (log-probs, entropy [B, T], route stats), holding only the parts asked for.
    """
    lp, ent, _, stats = logprobs_and_hidden(
        graphdef, params, input_ids, attention_mask, options,
        segment_ids=segment_ids, support=support, routes=routes,
    )  # fmt: skip
    out = (lp, ent) if with_entropy else (lp,)
    out = (*out, stats) if with_route_stats else out
    return out if len(out) > 1 else out[0]


def logprobs_and_hidden(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids: jax.Array,
    attention_mask: jax.Array | None,
    options: LogProbOptions,
    *,
    segment_ids: jax.Array | None = None,
    support: jax.Array | None = None,
    routes: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """``token_logprobs``'s pass with all it computes: (log-probs, entropy, both [B, T] and 0 at
    t=0; final hidden states [B, T, D]; route stats or None), for heads on the hidden states."""
    model = nnx.merge(graphdef, params)
    ids, positions, valid = model_inputs(input_ids, attention_mask, segment_ids)
    hidden, stats = model.hidden_states_and_routes(ids, positions, valid, options.remat, routes,
                                                   options.replay_routes)  # fmt: skip
    lp, ent = chunked_logprobs(
        hidden[:, :-1],
        model.unembedding(),
        ids[:, 1:],
        options,
        support=None if support is None else support[:, 1:],
    )
    zero = jnp.zeros_like(lp[:, :1])
    lp, ent = jnp.concatenate([zero, lp], 1), jnp.concatenate([zero, ent], 1)
    return lp, ent, hidden, stats


def chunked_logprobs(
    hidden: jax.Array,
    unembedding: jax.Array,
    targets: jax.Array,
    options: LogProbOptions = DEFAULT_LOGPROBS,
    *,
    support: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Log-prob of ``targets`` [B, T] and entropy, from hidden [B, T, D] and unembedding [D, V],
    at most ``options.chunk_size`` positions at a time (equal chunks, the fewest that fit:
    padding costs as much as real positions). Each chunk saves only its log-sum-exp for the
    backward; if the float32 [B, T, V] logits fit ``options.keep_logits_bytes``, it saves its
    logits instead, so the backward skips one [B·T, D] x [D, V] product. ``options.temperature``
    is applied to the hidden states (logits are linear in them). ``support`` [B, T, R] int (-1 =
    no entry): the token ids a sampler's top-k/top-p kept at each position; the distribution is
    then renormalised over them (a position with no entry keeps the whole vocabulary)."""
    if options.temperature != 1.0:
        hidden = hidden * jnp.asarray(1.0 / options.temperature, hidden.dtype)
    b, t, d = hidden.shape
    n = max(1, -(-t // options.chunk_size))
    chunk = max(1, -(-t // n))
    pad = n * chunk - t
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hidden = hidden.reshape(b, n, chunk, d).swapaxes(0, 1)
    targets = targets.reshape(b, n, chunk).swapaxes(0, 1)
    if support is not None:  # the chunk functions take (targets, support) as their targets
        support = jnp.pad(support, ((0, 0), (0, pad), (0, 0)), constant_values=-1)
        r = support.shape[-1]
        targets = (targets, support.reshape(b, n, chunk, r).swapaxes(0, 1))
    keep = b * t * unembedding.shape[-1] * 4 <= options.keep_logits_bytes
    one = _chunk_logprobs_kept if keep else _chunk_logprobs
    lp, ent = jax.lax.map(lambda xs: one(xs[0], unembedding, xs[1]), (hidden, targets))
    lp = lp.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
    ent = ent.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
    return lp, ent


def _chunk_logits(h: jax.Array, unembedding: jax.Array) -> jax.Array:
    lg = jnp.einsum("bcd,dv->bcv", h, unembedding, preferred_element_type=jnp.float32)
    return constrain(lg, BATCH, None, "tensor")


def _chunk_stats(
    h: jax.Array, unembedding: jax.Array, targets: Targets
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log-prob of ``targets``, entropy, log-sum-exp) of one chunk's logits."""
    return _logits_stats(_chunk_logits(h, unembedding), targets)


Targets = jax.Array | tuple[jax.Array, jax.Array]  # target ids [B, C], or (ids, support)


def _in_support(lg: jax.Array, support: jax.Array) -> jax.Array:
    """[B, C, V] bool: token v is in the position's support (every v where it has no entry)."""
    b, c, r = support.shape
    rows = jnp.arange(b)[:, None, None], jnp.arange(c)[None, :, None]
    member = jnp.zeros(lg.shape, jnp.bool_).at[(*rows, jnp.maximum(support, 0))].max(support >= 0)
    return member | ~jnp.any(support >= 0, axis=-1)[..., None]


def _logits_stats(lg: jax.Array, targets: Targets) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log-prob of ``targets``, entropy, log-sum-exp) of logits [B, C, V], over each position's
    support when ``targets`` carries one."""
    if isinstance(targets, tuple):
        targets, support = targets
        inside = _in_support(lg, support)
        lse = jax.nn.logsumexp(jnp.where(inside, lg, -jnp.inf), axis=-1)
        probs = jnp.where(inside, jnp.exp(lg - lse[..., None]), 0.0)
    else:
        lse = jax.nn.logsumexp(lg, axis=-1)
        probs = jnp.exp(lg - lse[..., None])
    picked = jnp.take_along_axis(lg, targets[..., None], axis=-1)[..., 0]
    entropy = lse - jnp.sum(probs * lg, axis=-1)
    return picked - lse, entropy, lse


def _primals(*args: Any) -> Any:
    """The values of a custom-VJP forward's arguments (each leaf wrapped in CustomVJPPrimal)."""
    return jax.tree.map(lambda x: x.value, args, is_leaf=lambda x: isinstance(x, CustomVJPPrimal))


@jax.custom_vjp
def _chunk_logprobs(
    h: jax.Array, unembedding: jax.Array, targets: Targets
) -> tuple[jax.Array, jax.Array]:
    """One chunk's (log-probs, entropy). Its backward recomputes the logits once and forms
    their cotangent in one pass from the saved log-sum-exp, where autodiff under
    ``jax.checkpoint`` re-runs the forward's reductions and scatters into a zero [B, C, V]."""
    lp, entropy, _ = _chunk_stats(h, unembedding, targets)
    return lp, entropy


def _chunk_logprobs_fwd(h: CustomVJPPrimal, unembedding: CustomVJPPrimal, targets: Any) -> tuple:
    h, unembedding, targets = _primals(h, unembedding, targets)
    lp, entropy, lse = _chunk_stats(h, unembedding, targets)
    return (lp, entropy), (h, unembedding, targets, lse, entropy)


def _chunk_logprobs_bwd(residuals: tuple, cotangents: tuple) -> tuple:
    h, unembedding, targets, lse, entropy = residuals
    lg = _chunk_logits(h, unembedding)
    return _chunk_grads(h, unembedding, targets, lse, entropy, lg, cotangents)


_chunk_logprobs.defvjp(_chunk_logprobs_fwd, _chunk_logprobs_bwd, symbolic_zeros=True)


@jax.custom_vjp
def _chunk_logprobs_kept(
    h: jax.Array, unembedding: jax.Array, targets: Targets
) -> tuple[jax.Array, jax.Array]:
    """``_chunk_logprobs`` whose forward keeps the chunk's logits for the backward."""
    lp, entropy, _ = _chunk_stats(h, unembedding, targets)
    return lp, entropy


def _chunk_logprobs_kept_fwd(
    h: CustomVJPPrimal, unembedding: CustomVJPPrimal, targets: Any
) -> tuple:
    h, unembedding, targets = _primals(h, unembedding, targets)
    lg = _chunk_logits(h, unembedding)
    lp, entropy, lse = _logits_stats(lg, targets)
    return (lp, entropy), (h, unembedding, targets, lse, entropy, lg)


def _chunk_logprobs_kept_bwd(residuals: tuple, cotangents: tuple) -> tuple:
    return _chunk_grads(*residuals, cotangents)


_chunk_logprobs_kept.defvjp(_chunk_logprobs_kept_fwd, _chunk_logprobs_kept_bwd, symbolic_zeros=True)


def _chunk_grads(
    h: jax.Array,
    unembedding: jax.Array,
    targets: Targets,
    lse: jax.Array,
    entropy: jax.Array,
    lg: jax.Array,
    cotangents: tuple,
) -> tuple:
    """The cotangents of a chunk's (h, unembedding) from its logits ``lg`` and statistics."""
    g_lp, g_entropy = cotangents
    probs = jnp.exp(lg - lse[..., None])
    if isinstance(targets, tuple):  # renormalised over the support: p = 0 outside it
        targets, support = targets
        probs = jnp.where(_in_support(lg, support), probs, 0.0)
    # d logp / d lg = onehot - p;  d entropy / d lg = -p * (lg - E_p[lg]), E_p[lg] = lse - H.
    # a cotangent nobody sent is a symbolic zero (the train step only reports the entropy):
    # skipping its term saves a pass over the [B, C, V] logits
    g_lg = jnp.zeros_like(lg)
    if not isinstance(g_lp, SymbolicZero):
        is_target = jnp.arange(lg.shape[-1], dtype=targets.dtype) == targets[..., None]
        g_lg = g_lp[..., None] * (is_target - probs)
    if not isinstance(g_entropy, SymbolicZero):
        mean_logit = (lse - entropy)[..., None]
        g_lg = g_lg - g_entropy[..., None] * probs * (lg - mean_logit)
    g_lg = constrain(g_lg, BATCH, None, "tensor")
    g_h = jnp.einsum("bcv,dv->bcd", g_lg, unembedding, preferred_element_type=jnp.float32)
    g_u = jnp.einsum("bcd,bcv->dv", h, g_lg, preferred_element_type=jnp.float32)
    return g_h.astype(h.dtype), g_u.astype(unembedding.dtype), None


def naive_token_logprobs(full_logits: jax.Array, input_ids: jax.Array) -> jax.Array:
    """Reference: log-softmax of full logits [B, T, V] gathered at the next tokens, 0 at t=0."""
    lsm = jax.nn.log_softmax(full_logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(lsm, jnp.asarray(input_ids)[:, 1:, None], axis=-1)[..., 0]
    return jnp.concatenate([jnp.zeros_like(picked[:, :1]), picked], axis=1)


def extend_cache(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    input_ids: jax.Array,
    positions: jax.Array,
    valid: jax.Array,
    cache: KVCache,
    start: jax.Array,
    fresh: bool = False,
    window: int | None = None,
    logits_at: jax.Array | None = None,
    unembedding: jax.Array | None = None,
    layers: Sequence[nnx.State] | None = None,
    with_routes: bool = False,
) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array | None]:
    """Prefill or decode: new tokens [B, T] against ``cache`` written at offsets ``start`` [B];
    (float32 logits [B, T, V], cache), and with ``with_routes`` the experts each new token was
    routed to ([B, T, L, k], None for a dense model). ``fresh``: an empty cache of exactly T
    entries at 0;
    ``window`` (static): read only the first ``window`` entries; ``logits_at`` [B]: only that
    token's logits, [B, 1, V] (a prefill's last prompt token); ``unembedding`` [D, V] and
    ``layers`` (``Transformer.unstack_layers``): the same weights in the caller's layout."""
    model = nnx.merge(graphdef, params)
    hidden, cache, routes = model.hidden_states_cached(
        jnp.asarray(input_ids, jnp.int32),
        positions,
        valid.astype(bool),
        cache,
        start,
        fresh,
        window,
        layers,
    )
    if logits_at is not None:
        hidden = jnp.take_along_axis(hidden, logits_at[:, None, None], axis=1)
    out = model.unembed(hidden, unembedding)
    return (out, cache, routes) if with_routes else (out, cache)
