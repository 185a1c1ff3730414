"""The sampler's device programs: prefill into the KV cache's slots and the decode loop.

Jitted at module level, so every Sampler of the same model and shapes shares their compilations;
the slot state and the per-request keys they read are built here too. Randomness is per request:
token i of a request is drawn with fold_in(key(seed, sample), i), whatever shares the batch."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tasks.models import forward
from rlax_tasks.models.kv_cache import KVCache, constrain_cache, init_cache
from rlax_tasks.rollout.held_weights import HeldWeights
from rlax_tasks.rollout.sampling import sample_tokens, token_key

NO_STOP = -1  # padding of the per-slot stop-id table


class SlotState(NamedTuple):
    """Per-slot decode state on device (leading dim = slots)."""

    last_token: jax.Array  # [S] int32: the token to feed next
    position: jax.Array  # [S] int32: its position = its cache index
    generated: jax.Array  # [S] int32: tokens generated so far (index of the next draw)
    budget: jax.Array  # [S] int32: max_new_tokens
    active: jax.Array  # [S] bool
    key: jax.Array  # [S, 2] uint32: the request's key
    temperature: jax.Array  # [S] float32
    top_k: jax.Array  # [S] int32
    top_p: jax.Array  # [S] float32
    stop_ids: jax.Array  # [S, M] int32, NO_STOP padded


def empty_state(slots: int, max_stop: int) -> SlotState:
    """Every slot free, as host arrays: the sampler's initial state (placed on its device) and
    an admission's rows before they are filled (built on the host: no device round trip)."""
    return SlotState(
        last_token=np.zeros(slots, np.int32),
        position=np.zeros(slots, np.int32),
        generated=np.zeros(slots, np.int32),
        budget=np.zeros(slots, np.int32),
        active=np.zeros(slots, bool),
        key=np.zeros((slots, 2), np.uint32),
        temperature=np.zeros(slots, np.float32),
        top_k=np.zeros(slots, np.int32),
        top_p=np.ones(slots, np.float32),
        stop_ids=np.full((slots, max_stop), NO_STOP, np.int32),
    )


def _seed_keys(seeds: Sequence[int]) -> np.ndarray:
    """key_data(PRNGKey(seed)) of each seed, [R, 2] uint32. Threefry without x64 keeps a seed's
    low 32 bits behind a zero word: computed here on the host rather than by one eager PRNGKey
    per new seed (a fresh seed per prompt, every step)."""
    if jax.config.jax_enable_x64 or jax.config.jax_default_prng_impl != "threefry2x32":
        return np.stack([_seed_key(int(s)) for s in seeds]).astype(np.uint32)
    keys = np.zeros((len(seeds), 2), np.uint32)
    keys[:, 1] = [int(s) & 0xFFFFFFFF for s in seeds]
    return keys


@functools.lru_cache(maxsize=65536)
def _seed_key(seed: int) -> np.ndarray:
    """key_data(PRNGKey(seed)), [2] uint32, computed by JAX (x64 or another PRNG)."""
    return np.asarray(jax.random.key_data(jax.random.PRNGKey(seed)))


@jax.jit
def fold_in_rows(seed_keys: jax.Array, sample_indices: jax.Array) -> jax.Array:
    """key_data(fold_in(seed key, sample index)) of every row, [R, 2] uint32, in one call."""
    fold = jax.vmap(lambda k, i: jax.random.fold_in(jax.random.wrap_key_data(k), i))
    return jax.random.key_data(fold(seed_keys, sample_indices))


def request_keys(seeds: Sequence[int], sample_indices: Sequence[int]) -> np.ndarray:
    """Each request's key, key_data(fold_in(PRNGKey(seed), sample_index)), as [R, 2] uint32:
    one device call for a whole admission rather than three eager ops per request."""
    n = len(seeds)
    if not n:
        return np.zeros((0, 2), np.uint32)
    rows = 1 << (n - 1).bit_length()  # padded to a power of two: a handful of compilations
    base = np.zeros((rows, 2), np.uint32)
    base[:n] = _seed_keys(seeds)
    indices = np.zeros(rows, np.uint32)
    indices[:n] = np.asarray(sample_indices, np.int64) & 0xFFFFFFFF  # wrapped as an int32 is
    return np.asarray(fold_in_rows(base, indices))[:n]


def _finished(tokens: jax.Array, generated: jax.Array, state: SlotState) -> jax.Array:
    hit_stop = jnp.any(tokens[:, None] == state.stop_ids, axis=-1)
    return hit_stop | (generated >= state.budget)


def _draw_first(
    logits: jax.Array,
    state: SlotState,
    slots: jax.Array,
    new: SlotState,
    position: jax.Array,
    flags: tuple[bool, bool, int],
) -> tuple[SlotState, jax.Array, jax.Array, jax.Array, jax.Array]:
    """An admission's first draw from each row's last logits [n, V], its rows written into
    ``state`` at ``slots`` (next ``position``); returns the state, tokens, log-probs, active
    flags and kept ids. ``flags``: (filtering, sampling, support), static. A continued request
    (``new.generated`` tokens already drawn) draws its next index of the same stream."""
    keys = jax.vmap(token_key)(new.key, new.generated)
    tokens, logprobs, kept = sample_tokens(
        logits, keys, new.temperature, new.top_k, new.top_p, *flags
    )
    generated = new.generated + 1
    active = ~_finished(tokens, generated, new)
    admitted = new._replace(
        last_token=tokens, position=position, generated=generated, active=active
    )
    state = jax.tree.map(lambda s, a: s.at[slots].set(a, mode="drop"), state, admitted)
    return state, tokens, logprobs, active, kept


def _prefill(
    config: Any,
    graphdef: nnx.GraphDef,
    params: nnx.State,
    held: HeldWeights,
    cache: KVCache,
    state: SlotState,
    ids: jax.Array,
    lengths: jax.Array,
    source: jax.Array | None,
    slots: jax.Array,
    new: SlotState,
    filtering: bool,
    sampling: bool,
    support: int = 0,
) -> tuple[KVCache, SlotState, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Prefills prompt ids [p, P] into cache rows ``slots`` [n] (out of range: padding, dropped)
    and draws each first token; returns cache, slot state, tokens, log-probs, active [n] and
    each token's kept support [n, ``support``] (static; ``sample_tokens``).
    ``source`` [n]: each row's prompt row, so a prompt several rows share (a group) is computed
    once and copied to their slots (None: row i is prompt i). ``new``: the rows' settings (a
    continued request's prompt ends with its tokens so far, ``new.generated`` of them);
    ``held``: only its output projection is read (a prefill's tokens share each layer)."""
    p, bucket = ids.shape
    positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (p, bucket))
    valid = positions < lengths[:, None]
    fresh = init_cache(config, p, bucket, cache.dtype)
    logits, fresh = forward.extend_cache(
        graphdef,
        params,
        ids,
        positions,
        valid,
        fresh,
        jnp.zeros(p, jnp.int32),
        fresh=True,
        logits_at=lengths - 1,
        unembedding=held.unembedding,
    )
    last = logits[:, 0]
    if source is not None:  # each admitted row takes its prompt's logits and cache entries
        last, lengths = last[source], lengths[source]
        fresh = fresh._replace(
            k=tuple(jnp.take(k, source, axis=0) for k in fresh.k),
            v=tuple(jnp.take(v, source, axis=0) for v in fresh.v),
        )
        positions = positions[source]
    state, tokens, logprobs, active, kept = _draw_first(
        last, state, slots, new, lengths, (filtering, sampling, support)
    )

    row_valid = jnp.arange(cache.max_len)[None, :] < lengths[:, None]
    cache = KVCache(
        k=tuple(
            c.at[slots, :, :, :bucket].set(f, mode="drop")
            for c, f in zip(cache.k, fresh.k, strict=True)
        ),
        v=tuple(
            c.at[slots, :, :bucket].set(f, mode="drop")
            for c, f in zip(cache.v, fresh.v, strict=True)
        ),
        positions=cache.positions.at[slots, :bucket].set(positions, mode="drop"),
        valid=cache.valid.at[slots].set(row_valid, mode="drop"),
    )
    return constrain_cache(cache), state, tokens, logprobs, active, kept


def _extend(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    held: HeldWeights,
    cache: KVCache,
    state: SlotState,
    ids: jax.Array,
    lengths: jax.Array,
    starts: jax.Array,
    slots: jax.Array,
    new: SlotState,
    filtering: bool,
    sampling: bool,
    support: int = 0,
) -> tuple[KVCache, SlotState, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Prefills ids [n, T] behind what cache rows ``slots`` [n] already hold (``starts`` [n]
    entries: an episode's earlier turns) and draws each row's first token; returns what
    ``_prefill`` does. Only the new tokens are computed: the rows' entries are gathered, extended
    at their offsets and written back (padding rows: ``slots`` out of range, dropped)."""
    width = ids.shape[1]
    rows = jnp.minimum(slots, cache.positions.shape[0] - 1)  # (padding rows read, never written)
    part = KVCache(
        k=tuple(jnp.take(c, rows, axis=0) for c in cache.k),
        v=tuple(jnp.take(c, rows, axis=0) for c in cache.v),
        positions=jnp.take(cache.positions, rows, axis=0),
        valid=jnp.take(cache.valid, rows, axis=0),
    )
    offsets = jnp.arange(width, dtype=jnp.int32)
    positions = starts[:, None] + offsets
    valid = offsets[None, :] < lengths[:, None]
    logits, part = forward.extend_cache(
        graphdef,
        params,
        ids,
        positions,
        valid,
        part,
        starts,
        logits_at=lengths - 1,
        unembedding=held.unembedding,
        layers=held.layers,
    )
    state, tokens, logprobs, active, kept = _draw_first(
        logits[:, 0], state, slots, new, starts + lengths, (filtering, sampling, support)
    )
    cache = KVCache(
        k=tuple(c.at[slots].set(f, mode="drop") for c, f in zip(cache.k, part.k, strict=True)),
        v=tuple(c.at[slots].set(f, mode="drop") for c, f in zip(cache.v, part.v, strict=True)),
        positions=cache.positions.at[slots].set(part.positions, mode="drop"),
        valid=cache.valid.at[slots].set(part.valid, mode="drop"),
    )
    return constrain_cache(cache), state, tokens, logprobs, active, kept


def _decode(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    held: HeldWeights,
    cache: KVCache,
    state: SlotState,
    steps: int,
    filtering: bool,
    sampling: bool,
    window: int | None,
    refill: jax.Array,
    support: int = 0,
    route_shape: tuple[int, int] = (0, 0),
) -> tuple[KVCache, SlotState, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Up to ``steps`` decode steps of every slot in one device loop: tokens, log-probs and
    emitted flags [steps, S], kept supports [steps, S, ``support``] (static), and a
    mixture-of-experts model's routes of the token each step fed, [steps, S, L, k] int16
    (``route_shape`` (L, k), static; (0, 0) for a dense model). Stop, EOS and
    length checks run here; the loop ends early when no slot is active or, with ``refill``
    (requests wait for a slot), once one has finished.
    ``window`` (static): attention reads only the first ``window`` cache entries, which hold
    every slot's tokens to the end of the call (``decode_window``)."""
    slots = state.active.shape[0]

    def step(carry: tuple) -> tuple:
        i, cache, st, out, ended = carry
        logits, cache, routes = forward.extend_cache(
            graphdef,
            params,
            st.last_token[:, None],
            st.position[:, None],
            st.active[:, None],
            cache,
            st.position,
            window=window,
            unembedding=held.unembedding,
            layers=held.layers,
            with_routes=True,
        )
        fed_routes = (
            jnp.zeros((slots, *route_shape), jnp.int16) if routes is None
            else routes[:, 0].astype(jnp.int16)
        )  # fmt: skip
        keys = jax.vmap(token_key)(st.key, st.generated)
        tokens, logprobs, kept = sample_tokens(
            logits[:, 0], keys, st.temperature, st.top_k, st.top_p, filtering, sampling, support
        )
        emitted = st.active
        generated = st.generated + emitted.astype(jnp.int32)
        active = emitted & ~_finished(tokens, generated, st)
        st = st._replace(
            last_token=jnp.where(emitted, tokens, st.last_token),
            position=st.position + emitted.astype(jnp.int32),
            generated=generated,
            active=active,
        )
        drawn = (tokens, logprobs, emitted, kept, fed_routes)
        out = tuple(o.at[i].set(x) for o, x in zip(out, drawn, strict=True))
        return i + 1, constrain_cache(cache), st, out, ended | jnp.any(emitted & ~active)

    def more(carry: tuple) -> jax.Array:
        i, _, st, _, ended = carry
        return (i < steps) & jnp.any(st.active) & ~(refill & ended)

    out = (
        jnp.zeros((steps, slots), jnp.int32),
        jnp.zeros((steps, slots), jnp.float32),
        jnp.zeros((steps, slots), bool),
        jnp.zeros((steps, slots, support), jnp.int32),
        jnp.zeros((steps, slots, *route_shape), jnp.int16),
    )
    start = (jnp.zeros((), jnp.int32), cache, state, out, jnp.zeros((), bool))
    _, cache, state, out, _ = jax.lax.while_loop(more, step, start)
    return cache, state, *out


# module-level: one compilation cache shared by every Sampler of the same model and shapes (the
# programs keep the names _prefill / _decode: the persistent cache's entries are named after them)
PREFILL = jax.jit(_prefill, static_argnums=(0, 1, 11, 12, 13), donate_argnums=(4, 5))
DECODE = jax.jit(_decode, static_argnums=(0, 5, 6, 7, 8, 10, 11), donate_argnums=(3, 4))
EXTEND = jax.jit(_extend, static_argnums=(0, 10, 11, 12), donate_argnums=(3, 4))


def admission_arrays(
    rows: int, bucket: int, prompt_rows: int | None, max_slots: int, max_stop: int
) -> tuple[Any, ...]:
    """An admission's host arrays for ``PREFILL``, every row padding until filled: prompt ids
    [prompt_rows or rows, bucket] and their lengths, each row's prompt row (None when
    ``prompt_rows`` is None), cache slots (``max_slots``: dropped) and the rows' ``SlotState``."""
    ids = np.zeros((prompt_rows or rows, bucket), np.int32)
    lengths = np.ones(prompt_rows or rows, np.int32)
    source = None if prompt_rows is None else np.zeros(rows, np.int32)
    slots = np.full(rows, max_slots, np.int32)
    return ids, lengths, source, slots, empty_state(rows, max_stop)
