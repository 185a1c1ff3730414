"""The rollout engine: jitted prefill + decode over a preallocated KV cache, continuous batching.

The cache has ``max_slots`` rows of ``max_len`` entries. A request occupies one slot: its prompt is
prefilled (right-padded to a power-of-two bucket, so a handful of shapes compile once), then all
slots decode together, ``decode_chunk`` tokens per device call. When a slot finishes, the next
waiting request is prefilled into it while the others keep decoding (continuous batching);
``batching="static"`` instead waits for every slot to be free (the classic baseline).

Randomness is per request: token i of a request is drawn with fold_in(key(seed, sample), i), so the
same seed gives the same completion whatever else shares the batch.

With JAX's persistent compilation cache on (every run's processes have it), a background thread
compiles ahead, into that cache, the programs generation is about to need: the prefill of every
other admission size at a prompt bucket once admissions there came in two sizes, and the decode
of every attention window up to the longest the slots' requests can reach. Their first calls then
read the cache (milliseconds) instead of stalling generation on a compile (a second each for a
tiny model on CPU, far more on a TPU).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rlax_tasks.models import forward
from rlax_tasks.models.kv_cache import KVCache, cache_shardings, constrain_cache, init_cache
from rlax_tasks.models.policy import Policy
from rlax_tasks.models.transformer import resolve_dtype
from rlax_tasks.rollout.requests import Completion, FinishReason, Request, SamplingParams
from rlax_tasks.rollout.sampling import sample_tokens, token_key
from rlax_tasks.utils.validation import check_choice, check_int, field_error

log = logging.getLogger(__name__)

# the smallest prefill bucket: tiny-arith's 5-7-token prompts padded to 16 ran twice the rows
# they needed (256 of them with 8 new tokens: 29.8 -> 25.7 ms median, same process, alternating)
MIN_BUCKET = 8
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


def _empty_state(slots: int, max_stop: int) -> SlotState:
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
    low 32 bits behind a zero word: computed here on the host, where one eager PRNGKey per new
    seed cost ~0.3 ms (a fresh seed per prompt, every step)."""
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
def _fold_in_rows(seed_keys: jax.Array, sample_indices: jax.Array) -> jax.Array:
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
    return np.asarray(_fold_in_rows(base, indices))[:n]


def _finished(tokens: jax.Array, generated: jax.Array, state: SlotState) -> jax.Array:
    hit_stop = jnp.any(tokens[:, None] == state.stop_ids, axis=-1)
    return hit_stop | (generated >= state.budget)


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
) -> tuple[KVCache, SlotState, jax.Array, jax.Array, jax.Array]:
    """Prefills prompts ids [p, P] into cache rows ``slots`` [n] and draws each first token.

    ``source`` [n]: the prompt row of each admitted row, so a prompt that several rows share
    (a group's G samples) is computed once and its cache entries copied to each of their
    slots; None: row i is prompt i (p == n). Rows whose slot index is out of range (padding of
    the admission bucket) are computed and dropped. ``new`` holds the admitted requests'
    settings ([n] leading dims); ``held``: the sampler's own copies of weights
    (``held_weights``; a prefill reads only the output projection: its many tokens share each
    layer's weights). Returns the cache, the slot state, first tokens [n], their log-probs [n]
    and whether each row is still active.
    """
    p, bucket = ids.shape
    positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (p, bucket))
    valid = positions < lengths[:, None]
    fresh = init_cache(config, p, bucket, cache.k.dtype)
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
            k=jnp.take(fresh.k, source, axis=1), v=jnp.take(fresh.v, source, axis=1)
        )
        positions = positions[source]
    n = last.shape[0]
    keys = jax.vmap(token_key)(new.key, jnp.zeros(n, jnp.int32))
    tokens, logprobs = sample_tokens(
        last, keys, new.temperature, new.top_k, new.top_p, filtering, sampling
    )
    generated = jnp.ones(n, jnp.int32)
    active = ~_finished(tokens, generated, new)

    row_valid = jnp.arange(cache.max_len)[None, :] < lengths[:, None]
    cache = KVCache(
        k=cache.k.at[:, slots, :, :, :bucket].set(fresh.k, mode="drop"),
        v=cache.v.at[:, slots, :, :bucket].set(fresh.v, mode="drop"),
        positions=cache.positions.at[slots, :bucket].set(positions, mode="drop"),
        valid=cache.valid.at[slots].set(row_valid, mode="drop"),
    )
    admitted = new._replace(last_token=tokens, position=lengths, generated=generated, active=active)
    state = jax.tree.map(lambda s, a: s.at[slots].set(a, mode="drop"), state, admitted)
    return constrain_cache(cache), state, tokens, logprobs, active


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
) -> tuple[KVCache, SlotState, jax.Array, jax.Array, jax.Array]:
    """Up to ``steps`` decode steps of every slot in one device loop; returns tokens, log-probs
    and emitted flags [steps, S] (rows past the last step run: nothing emitted).

    Stop, EOS and length checks run on the device: a slot that finishes stops emitting and
    writing. The loop ends early when no slot is active, or, with ``refill`` (a bool scalar: the
    host has requests waiting for a slot), as soon as a slot has finished. ``window`` (static):
    attention reads only the first ``window`` cache entries, which hold every slot's tokens to
    the end of the call (``decode_window``).
    """
    slots = state.active.shape[0]

    def step(carry: tuple) -> tuple:
        i, cache, st, out, ended = carry
        logits, cache = forward.extend_cache(
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
        )
        keys = jax.vmap(token_key)(st.key, st.generated)
        tokens, logprobs = sample_tokens(
            logits[:, 0], keys, st.temperature, st.top_k, st.top_p, filtering, sampling
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
        out = tuple(o.at[i].set(x) for o, x in zip(out, (tokens, logprobs, emitted), strict=True))
        return i + 1, constrain_cache(cache), st, out, ended | jnp.any(emitted & ~active)

    def more(carry: tuple) -> jax.Array:
        i, _, st, _, ended = carry
        return (i < steps) & jnp.any(st.active) & ~(refill & ended)

    out = (
        jnp.zeros((steps, slots), jnp.int32),
        jnp.zeros((steps, slots), jnp.float32),
        jnp.zeros((steps, slots), bool),
    )
    start = (jnp.zeros((), jnp.int32), cache, state, out, jnp.zeros((), bool))
    _, cache, state, out, _ = jax.lax.while_loop(more, step, start)
    return cache, state, *out


# module-level: one compilation cache shared by every Sampler of the same model and shapes
_PREFILL = jax.jit(_prefill, static_argnums=(0, 1, 11, 12), donate_argnums=(4, 5))
_DECODE = jax.jit(_decode, static_argnums=(0, 5, 6, 7, 8), donate_argnums=(3, 4))
_UNEMBEDDING = jax.jit(
    lambda graphdef, params: nnx.merge(graphdef, params).unembedding(), static_argnums=0
)
_UNSTACK_LAYERS = jax.jit(
    lambda graphdef, params: nnx.merge(graphdef, params).unstack_layers(), static_argnums=0
)


def _weights_device(policy: Policy) -> jax.Device:
    """The device a policy's weights are on (one of them when sharded)."""
    return next(iter(jax.tree.leaves(policy.params)[0].devices()))


class HeldWeights(NamedTuple):
    """Copies of weights a sampler keeps beside its policy's, in the layouts its decode reads
    fastest (``held_weights``); None where it uses the policy's own."""

    unembedding: jax.Array | None  # [D, V] (``held_unembedding``)
    layers: tuple[nnx.State, ...] | None  # each decoder layer's own arrays (``held_layers``)

    def delete(self) -> None:
        """Frees the copies' device buffers (before new weights are placed)."""
        for a in jax.tree.leaves(tuple(self)):
            a.delete()


def _holds_copies(policy: Policy) -> bool:
    """Whether a sampler keeps decode-layout copies of ``policy``'s weights: on a CPU without a
    mesh (measured there); accelerators keep the one copy of their scarcer memory."""
    return policy.mesh is None and _weights_device(policy).platform == "cpu"


def held_weights(policy: Policy) -> HeldWeights:
    """The copies a sampler of ``policy`` holds (``HeldWeights``)."""
    return HeldWeights(held_unembedding(policy), held_layers(policy))


def held_layers(policy: Policy) -> tuple[nnx.State, ...] | None:
    """Each decoder layer's weights as arrays of their own, which decode runs one after the
    other, or None (decode scans the stacked layers).

    A scan over the stacked layers slices each layer's weights out of the stack at every step,
    and XLA:CPU copies the slices before the matmuls read them: a one-token decode step moved
    every layer weight twice (27% of a 16-slot decode of the 30M benchmark model in the
    profile). Costs one more copy of the layer weights and a decode program unrolled over the
    layers (longer to compile).
    """
    if not _holds_copies(policy):
        return None
    with policy._scope():
        return _UNSTACK_LAYERS(policy.graphdef, policy.params)


def held_unembedding(policy: Policy) -> jax.Array | None:
    """The [D, V] output projection a sampler keeps beside its weights, or None (use the
    model's): a copy of a tied [V, D] embedding, transposed, on a CPU without a mesh.

    XLA:CPU's dot reads the tied embedding transposed at every token: with this copy the 30M
    benchmark model decoded 16 slots 6% faster (937 -> 991 tokens/s, same process; 1% at 64
    slots), for V x D more memory. Untied models hold their lm head as [D, V] already;
    accelerators are unmeasured, so they keep the one copy.
    """
    if not policy.config.tie_word_embeddings or not _holds_copies(policy):
        return None
    with policy._scope():
        return _UNEMBEDDING(policy.graphdef, policy.params)


# the smallest attention window of a decode chunk: windows grow by 1.5x or 4/3 (at most max_len),
# so a sampler compiles a handful of decode programs
MIN_WINDOW = 64


def _power_of_two_bucket(n: int, smallest: int, max_len: int) -> int:
    """The next power of two >= n, at least ``smallest``, at most max_len: a few static shapes."""
    return min(max(smallest, 1 << (n - 1).bit_length()), max_len)


def decode_window(end: int, max_len: int) -> int:
    """The cache entries a decode chunk attends over when its slots' tokens end before ``end``:
    the smallest window covering ``end`` of MIN_WINDOW times 1, 1.5, 2, 3, 4, 6, 8, ... (two
    per octave), at most max_len.

    Each decode step copies every layer's window out of the cache and attends over it, so the
    window's slack is paid per token: with powers of two alone (up to 2x the entries in use)
    64 slots of the 30M benchmark model decoded 2,525 tokens/s, with two per octave 2,760
    (same process, alternating), for twice the decode programs (one per window).
    """
    octave = 1 << (max(end, MIN_WINDOW) - 1).bit_length()  # a power of two >= end
    half_step = max(octave * 3 // 4, MIN_WINDOW)  # the window between octave / 2 and octave
    return min(half_step if end <= half_step else octave, max_len)


def admission_sizes(max_slots: int) -> list[int]:
    """The row counts an admission is padded to: powers of two from ``max_slots / 16`` (so the
    padding of a small admission costs at most a sixteenth of a full one) to ``max_slots``'s."""
    top = 1 << (max_slots - 1).bit_length()
    smallest = max(1, top // 16)
    return [1 << i for i in range(smallest.bit_length() - 1, top.bit_length())]


def admission_rows(n: int, max_slots: int) -> int:
    """The padded row count of an admission of ``n`` requests (see ``admission_sizes``)."""
    return next(size for size in admission_sizes(max_slots) if size >= n)


def prompt_bucket(length: int, max_len: int) -> int:
    """The padded prefill length for a prompt: the next power of two (>= MIN_BUCKET), at most
    max_len."""
    return _power_of_two_bucket(length, MIN_BUCKET, max_len)


@dataclasses.dataclass
class _Slot:
    request: Request
    tokens: list[int]
    logprobs: list[float]
    stop_set: frozenset[int]
    eos: frozenset[int]


@dataclasses.dataclass
class SamplerStats:
    """Counters for progress lines and benchmarks."""

    prefill_calls: int = 0
    decode_calls: int = 0
    generated_tokens: int = 0
    completions: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    last_swap_s: float | None = None


class Sampler:
    """KV-cache sampler with continuous batching over ``max_slots`` slots of ``max_len`` tokens.

    ``generate`` is the one-call API; ``add_request`` / ``step`` / ``abort`` drive it
    incrementally (the inference worker does, to drop partial rollouts on a weight reload).
    ``precompile``: compile the other admission sizes and decode windows in the background
    (only when JAX's persistent compilation cache is on; see the module docstring).
    ``decode_chunk``: decode steps per device call (a slot that ends returns earlier when
    requests wait). 8 rather than 4: the tiny preset's 8-token completions in one call (256 of
    them 15.8 -> 14.7 ms, same process, alternating); 64 slots of the 30M benchmark model
    decoded as fast with 4, 8 or 16.
    """

    def __init__(
        self,
        policy: Policy,
        max_slots: int = 32,
        max_len: int = 2048,
        *,
        decode_chunk: int = 8,
        batching: Literal["continuous", "static"] = "continuous",
        max_stop_ids: int = 8,
        precompile: bool = True,
    ) -> None:
        error = field_error(ValueError)
        check_int("max_slots", max_slots, error, minimum=1)
        check_int("max_len", max_len, error, minimum=2)
        check_int("decode_chunk", decode_chunk, error, minimum=1)
        check_choice("batching", batching, ("continuous", "static"), error)
        # committed placement, as set_params makes it: a swap then never changes the jit cache key
        self.policy = policy.with_params(
            jax.device_put(policy.params, jax.tree.map(lambda a: a.sharding, policy.params))
        )
        # the weights' buffers are the sampler's own only once set_params placed them: before
        # that they may be the caller's, which an in-place reload must not free
        self._owns_params = False
        self._held = held_weights(self.policy)
        # read from the model's configs once: every request looks them up (512 a tiny step)
        self._eos_ids = frozenset(self.policy.eos_token_ids)
        self.max_slots, self.max_len = max_slots, max_len
        self.decode_chunk, self.batching = decode_chunk, batching
        self.max_stop_ids = max_stop_ids
        self.stats = SamplerStats()
        dtype = resolve_dtype(policy.dtype)  # the compute dtype: what attention reads
        # committed buffers, like every later prefill/decode output: the first call then
        # compiles the same program as all the others
        # on a mesh the cache is sharded (slots over data/fsdp, kv heads over tensor) and the
        # small slot state replicated; without one, both live on the weights' device
        cache = jax.eval_shape(lambda: init_cache(policy.config, max_slots, max_len, dtype))
        if policy.mesh is not None:
            place = jax.sharding.NamedSharding(policy.mesh, jax.sharding.PartitionSpec())
            cache_place = cache_shardings(cache, policy.mesh)
        else:
            place = jax.sharding.SingleDeviceSharding(_weights_device(self.policy))
            cache_place = KVCache(*([place] * len(KVCache._fields)))
        self._cache = jax.jit(
            lambda: init_cache(policy.config, max_slots, max_len, dtype), out_shardings=cache_place
        )()
        self._state = jax.device_put(_empty_state(max_slots, max_stop_ids), place)
        self._slots: list[_Slot | None] = [None] * max_slots
        self._waiting: collections.deque[Request] = collections.deque()
        self._prefill_fn = _PREFILL
        self._decode_fn = _DECODE
        # background compilation into the persistent cache (see the module docstring)
        self.precompile = precompile
        self._precompiled: set[tuple] = set()  # (kind..., shape) compiled or under way
        # (bucket, filtering, sampling) -> {(rows, prompt rows)} admitted
        self._admissions_seen: dict[tuple, set[tuple[int, int | None]]] = {}
        self._rows_per_prompt = 1  # the most requests per distinct prompt an admission had
        self._precompiling: list[threading.Thread] = []
        self._stop_precompiling = threading.Event()

    # ------------------------------------------------------------------ weights
    @property
    def params(self) -> nnx.State:
        return self.policy.params

    def set_params(self, params: nnx.State, *, donate: bool = False) -> float:
        """Swaps in new weights of the same shapes (no recompilation); returns the seconds taken.

        Requests in flight continue with the new weights; callers that need every completion to
        come from one version (the worker) ``abort`` first. Once the sampler owns its weights
        (after the first swap) the swap is in place: each old array is freed before its
        replacement is placed, so the device never holds two full copies. ``donate``: device
        arrays already in the sampler's dtype and placement are taken over as they are (the
        sampler frees them at the next swap): the caller must not use them again.
        """
        t0 = time.perf_counter()
        old = jax.tree_util.tree_leaves_with_path(self.policy.params)
        new = jax.tree_util.tree_leaves_with_path(params)
        if len(old) != len(new):
            raise ValueError(f"new weights have {len(new)} arrays, the policy has {len(old)}")
        for (path, a), (new_path, b) in zip(old, new, strict=True):
            if path != new_path or a.shape != b.shape:
                name = jax.tree_util.keystr(path)
                raise ValueError(
                    f"new weights do not match the policy at {name}: "
                    f"{jax.tree_util.keystr(new_path)} {tuple(b.shape)} vs {tuple(a.shape)}"
                )
        treedef = jax.tree.structure(self.policy.params)
        # the copies are freed first: never two of them beside two weights
        self._held.delete()
        self._held = HeldWeights(None, None)
        placed = []
        for (_, a), (_, b) in zip(old, new, strict=True):
            sharding, dtype = a.sharding, a.dtype
            if self._owns_params:
                a.delete()
            if donate and isinstance(b, jax.Array) and b.sharding == sharding and b.dtype == dtype:
                # already placed as the sampler holds it (a colocated run's trainer weights,
                # cast and copied device to device): taken over as is, no host round trip
                placed.append(b)
                continue
            host = np.asarray(b)  # a host copy (device inputs: fetched before being cast)
            placed.append(jax.device_put(host.astype(dtype, copy=False), sharding))
            jax.block_until_ready(placed[-1])
        del old
        self.policy = self.policy.with_params(jax.tree.unflatten(treedef, placed))
        self._owns_params = True
        self._held = held_weights(self.policy)
        self.stats.last_swap_s = time.perf_counter() - t0
        return self.stats.last_swap_s

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queues one request; validates it first (ValueError naming the problem)."""
        self.validate(request)
        self._waiting.append(request)

    def validate(self, request: Request) -> None:
        """Raises ValueError naming what is wrong with a request for this sampler."""
        request.params.validate(self.policy.config.vocab_size)
        n = len(request.prompt)
        if n == 0:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        vocab = self.policy.config.vocab_size
        if min(request.prompt) < 0 or max(request.prompt) >= vocab:
            raise ValueError(
                f"request {request.request_id!r}: prompt token ids must lie in [0, {vocab})"
            )
        if n + request.params.max_new_tokens > self.max_len:
            raise ValueError(
                f"request {request.request_id!r}: prompt ({n} tokens) + max_new_tokens "
                f"({request.params.max_new_tokens}) exceeds the sampler's max_len {self.max_len}"
            )
        if len(self._stop_set(request.params)) > self.max_stop_ids:
            raise ValueError(
                f"request {request.request_id!r}: more than {self.max_stop_ids} stop token ids"
            )
        if request.params.stop_strings and self.policy.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer; the policy has none")

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    @property
    def num_active(self) -> int:
        return sum(s is not None for s in self._slots)

    def abort(self) -> list[Request]:
        """Drops every waiting and in-flight request (their partial output is discarded)."""
        dropped = list(self._waiting) + [s.request for s in self._slots if s is not None]
        self._waiting.clear()
        self._slots = [None] * self.max_slots
        # placed like the rest of the state: an uncommitted array here made the next prefill
        # and decode compile a second program for every admission shape (once per reload)
        active = jax.device_put(np.zeros(self.max_slots, bool), self._state.active.sharding)
        self._state = self._state._replace(active=active)
        return dropped

    def step(self) -> list[Completion]:
        """Admits waiting requests into free slots, runs one decode chunk; returns what finished."""
        finished: list[Completion] = []
        self._admit(finished)
        if any(s is not None for s in self._slots):
            self._decode_chunk(finished)
        self.stats.completions += len(finished)
        return finished

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        seed: int = 0,
        n: int = 1,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_token_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        ignore_eos: bool = False,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        on_complete: Callable[[Completion], None] | None = None,
    ) -> list[Completion]:
        """n completions per prompt, prompt-major. ``params`` (one, or one per prompt) overrides
        the keyword settings. ``seed`` is per request: every prompt given the same seed draws
        the same random numbers, so pass ``params=per_prompt_params(seed, len(prompts), ...)``
        when the prompts' samples must be independent (evaluation). ``on_complete`` is called
        with each completion as it finishes (progress)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if params is None:
            params = SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=float(temperature),
                top_p=float(top_p),
                top_k=int(top_k),
                seed=int(seed),
                stop_token_ids=tuple(int(t) for t in stop_token_ids),
                stop_strings=tuple(stop_strings),
                ignore_eos=ignore_eos,
            )
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else params
        if len(per_prompt) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        if self.has_unfinished:
            raise RuntimeError("generate() needs an idle sampler; requests are in flight")
        requests = [
            Request.make(prompt, p, sample_index=j, request_id=(i, j))
            for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True))
            for j in range(n)
        ]
        for request in requests:  # all or nothing: nothing is queued if one is invalid
            self.validate(request)
        self._waiting.extend(requests)
        done: dict[Any, Completion] = {}
        while self.has_unfinished:
            for c in self.step():
                done[c.request.request_id] = c
                if on_complete is not None:
                    on_complete(c)
        return [done[r.request_id] for r in requests]

    # ------------------------------------------------------------------ internals
    def _stop_set(self, p: SamplingParams) -> frozenset[int]:
        eos = frozenset() if p.ignore_eos else self._eos_ids
        return eos | frozenset(p.stop_token_ids)

    def _stop_sets(self, params: list[SamplingParams]) -> list[frozenset[int]]:
        """``_stop_set`` of each, computed once per distinct settings object (a step's
        requests usually share one)."""
        seen: dict[int, frozenset[int]] = {}
        for p in params:
            if id(p) not in seen:
                seen[id(p)] = self._stop_set(p)
        return [seen[id(p)] for p in params]

    def _admission_arrays(
        self, rows: int, bucket: int, prompt_rows: int | None = None
    ) -> tuple[Any, ...]:
        """An admission's host arrays, every row padding until filled: prompt ids [prompt_rows,
        bucket] and their lengths, each row's prompt row (None when every row has its own:
        ``prompt_rows`` None), cache slots (out of range: dropped) and the rows' ``SlotState``."""
        ids = np.zeros((prompt_rows or rows, bucket), np.int32)
        lengths = np.ones(prompt_rows or rows, np.int32)
        source = None if prompt_rows is None else np.zeros(rows, np.int32)
        slots = np.full(rows, self.max_slots, np.int32)
        new = _empty_state(rows, self.max_stop_ids)
        return ids, lengths, source, slots, new

    def _prompt_rows(self, rows: int, distinct: int) -> int | None:
        """The padded prompt rows of an admission of ``rows`` whose requests hold ``distinct``
        prompts, or None when sharing would not compute fewer rows (each row its own prompt)."""
        shared = admission_rows(distinct, self.max_slots)
        return shared if shared < rows else None

    def _admit(self, finished: list[Completion]) -> None:
        free = [i for i, s in enumerate(self._slots) if s is None]
        if not self._waiting or not free:
            return
        if self.batching == "static" and len(free) < self.max_slots:
            return
        take = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
        rows = admission_rows(len(take), self.max_slots)
        bucket = prompt_bucket(max(len(r.prompt) for r in take), self.max_len)
        # equal prompts (a group's G samples) are prefilled once: rows -> their prompt's row
        prompt_of: dict[tuple[int, ...], int] = {}
        rows_prompt = [prompt_of.setdefault(tuple(r.prompt), len(prompt_of)) for r in take]
        prompt_rows = self._prompt_rows(rows, len(prompt_of))
        ids, lengths, source, slots, new = self._admission_arrays(rows, bucket, prompt_rows)
        # filled column by column: the tiny preset admits 256 requests at a time
        n = len(take)
        params = [r.params for r in take]
        if source is None:
            prompts = [r.prompt for r in take]
        else:
            prompts = list(prompt_of)
            source[:n] = rows_prompt
            self._rows_per_prompt = max(self._rows_per_prompt, n // len(prompts))
        filled = len(prompts)
        lengths[:filled] = [len(prompt) for prompt in prompts]
        ids[:filled][np.arange(bucket) < lengths[:filled, None]] = [
            t for prompt in prompts for t in prompt
        ]
        slots[:n] = free[:n]
        new.budget[:n] = [p.max_new_tokens for p in params]
        new.temperature[:n] = [p.temperature for p in params]
        new.top_k[:n] = [p.top_k for p in params]
        new.top_p[:n] = [p.top_p for p in params]
        stop_sets = self._stop_sets(params)
        for row, stops in enumerate(stop_sets):
            new.stop_ids[row, : len(stops)] = sorted(stops)
        new.key[:n] = request_keys([p.seed for p in params], [r.sample_index for r in take])
        filtering = any(p.filtering for p in params)
        sampling = any(p.temperature > 0 for p in params)
        self._precompile_admissions(rows, prompt_rows, bucket, filtering, sampling)
        t0 = time.perf_counter()
        with self.policy._scope():
            self._cache, self._state, tokens, logprobs, active = self._prefill_fn(
                self.policy.config,
                self.policy.graphdef,
                self.policy.params,
                self._held,
                self._cache,
                self._state,
                ids,
                lengths,
                source,
                slots,
                new,
                filtering,
                sampling,
            )
            tokens, logprobs, active = jax.device_get((tokens, logprobs, active))
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.prefill_calls += 1
        # the admitted rows first (padding rows after them), each with its free slot
        tokens, logprobs, active = tokens[:n].tolist(), logprobs[:n].tolist(), active[:n].tolist()
        rows_out = zip(take, free[:n], stop_sets, tokens, logprobs, active, strict=True)
        for request, slot, stops, token, logprob, still in rows_out:
            eos = frozenset() if request.params.ignore_eos else self._eos_ids
            self._slots[slot] = _Slot(request, [], [], stops, eos)
            self._emit(slot, token, logprob, still, finished)

    # ------------------------------------------------------------------ precompilation
    def _precompile_admissions(
        self, rows: int, prompt_rows: int | None, bucket: int, filtering: bool, sampling: bool
    ) -> None:
        """Once admissions at (bucket, filtering, sampling) came in three sizes (their size
        varies: continuous batching refilling slots as they free), the prefill of every other
        admission size (``admission_sizes``) compiles in the background, with the prompt rows
        its groups of equal prompts make likely (``_likely_prompt_rows``; again when larger
        groups come). A workload that admits whole batches compiles nothing it would not use:
        its first batches often come in two sizes (the first requests trickle in while the
        first admission runs), and compiling the other sizes then cost the colocated tiny-arith
        run ~2 s of Python beside its first training step (warm cache), or several needless XLA
        compiles (cold)."""
        seen = self._admissions_seen.setdefault((bucket, filtering, sampling), set())
        seen.add((rows, prompt_rows))
        if len({n for n, _ in seen}) < 3:
            return
        shapes = self._not_precompiled(
            ("prefill", bucket, filtering, sampling),
            [
                (n, likely)
                for n in admission_sizes(self.max_slots)
                for likely in self._likely_prompt_rows(n)
                if (n, likely) not in seen
            ],
        )
        if not shapes:
            return
        args = self._abstract_state()

        def lower(n: int, prompt_rows: int | None) -> list[Any]:
            cfg, graphdef = self.policy.config, self.policy.graphdef
            ids, lengths, source, slots, new = self._admission_arrays(n, bucket, prompt_rows)
            prefill = self._prefill_fn.lower(
                cfg, graphdef, *args, ids, lengths, source, slots, new, filtering, sampling
            )
            seeds, indices = np.zeros((n, 2), np.uint32), np.zeros(n, np.uint32)
            return [prefill, _fold_in_rows.lower(seeds, indices)]

        what = f"admissions of (rows, prompt rows) {shapes} at prompt bucket {bucket}"
        self._start_precompiling(what, [functools.partial(lower, *shape) for shape in shapes])

    def _likely_prompt_rows(self, rows: int) -> list[int | None]:
        """The prompt rows an admission of ``rows`` is likely to come with: every row its own
        prompt, and, once admissions shared prompts (groups of G), whole groups or one more
        (a group split between two admissions)."""
        out: list[int | None] = [None]
        g = self._rows_per_prompt
        if g > 1:
            whole_groups = -(-rows // g)
            for distinct in (whole_groups, whole_groups + 1):
                prompt_rows = self._prompt_rows(rows, distinct)
                if prompt_rows not in out:
                    out.append(prompt_rows)
        return out

    def _precompile_decodes(self, window: int, reach: int, filtering: bool, sampling: bool) -> None:
        """The attention windows the slots' requests will reach (``reach``: their longest
        prompt + max_new_tokens) past the current ``window`` compile in the background."""
        windows, w = [], window
        while w < decode_window(reach, self.max_len):
            w = decode_window(w + 1, self.max_len)
            windows.append(w)
        self._precompiled.add(("decode", filtering, sampling, window))  # compiles now, here
        windows = self._not_precompiled(("decode", filtering, sampling), windows)
        if not windows:
            return
        args = self._abstract_state()
        refill = np.bool_(False)

        def lower(w: int) -> list[Any]:
            graphdef, chunk = self.policy.graphdef, self.decode_chunk
            return [self._decode_fn.lower(graphdef, *args, chunk, filtering, sampling, w, refill)]

        what = f"decode windows {windows}"
        self._start_precompiling(what, [functools.partial(lower, w) for w in windows])

    def _not_precompiled(self, kind: tuple, shapes: list[Any]) -> list[Any]:
        """Those of ``shapes`` (of programs ``kind``) to precompile now, marked as done: none
        without a persistent cache to fill (see the module docstring)."""
        if not self.precompile or not jax.config.jax_compilation_cache_dir:
            return []
        todo = [n for n in shapes if (*kind, n) not in self._precompiled]
        self._precompiled.update((*kind, n) for n in todo)
        return todo

    def _abstract_state(self) -> tuple[Any, Any, Any, Any]:
        """(params, held copies, cache, slot state) as shapes with their placements: what a
        background lowering reads while generation goes on with (and donates) the arrays."""

        def spec(a: jax.Array) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)

        held = (self.policy.params, self._held, self._cache, self._state)
        return jax.tree.map(spec, held)

    def _start_precompiling(self, what: str, lowerings: list[Callable[[], list[Any]]]) -> None:
        if not lowerings:
            return
        scope = self.policy._scope

        def run() -> None:
            t0 = time.perf_counter()
            with contextlib.suppress(OSError, AttributeError):  # Linux: this thread only
                # the lowest CPU priority: generation and training go first, the compilations
                # fill the cores' idle time
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            try:
                for lower in lowerings:
                    if self._stop_precompiling.is_set() or not threading.main_thread().is_alive():
                        log.debug("precompiling %s: stopped", what)
                        return
                    with scope():
                        for lowered in lower():
                            lowered.compile()
            except Exception:  # a failure here only costs the compile later, in the foreground
                log.warning("precompiling %s failed", what, exc_info=True)
                return
            log.info("precompiled %s in %.1fs", what, time.perf_counter() - t0)

        # not a daemon: a daemon thread inside XLA's compiler when the interpreter exits aborts
        # the process (exit 134). The exit waits for the compilation under way, then the thread
        # stops (the main thread is no longer alive), as it does after stop_precompiling().
        thread = threading.Thread(target=run, name="sampler-precompile", daemon=False)
        self._precompiling.append(thread)
        thread.start()

    def stop_precompiling(self) -> None:
        """Background compilations end after the one under way (a worker that stops)."""
        self._stop_precompiling.set()

    def wait_precompiled(self, timeout_s: float | None = None) -> None:
        """Waits for the background compilations started so far (tests, benchmarks)."""
        for thread in self._precompiling:
            thread.join(timeout_s)

    def _decode_chunk(self, finished: list[Completion]) -> None:
        slots = [s for s in self._slots if s is not None]
        live = [s.request.params for s in slots]
        filtering = any(p.filtering for p in live)
        sampling = any(p.temperature > 0 for p in live)
        # a slot's next token goes to cache entry len(prompt) + generated - 1: after this chunk
        # every entry written lies below ``end``
        end = max(len(s.request.prompt) + len(s.tokens) for s in slots) + self.decode_chunk
        window = decode_window(end, self.max_len)
        reach = max(len(s.request.prompt) + s.request.params.max_new_tokens for s in slots)
        self._precompile_decodes(window, reach, filtering, sampling)
        t0 = time.perf_counter()
        with self.policy._scope():
            self._cache, self._state, tokens, logprobs, emitted = self._decode_fn(
                self.policy.graphdef,
                self.policy.params,
                self._held,
                self._cache,
                self._state,
                self.decode_chunk,
                filtering,
                sampling,
                window,
                # continuous batching: back to the host as soon as a slot frees for a waiting
                # request (static batching refills only when every slot is free)
                np.bool_(self.batching == "continuous" and bool(self._waiting)),
            )
            tokens, logprobs, emitted, active = jax.device_get(
                (tokens, logprobs, emitted, self._state.active)
            )
        self.stats.decode_s += time.perf_counter() - t0
        self.stats.decode_calls += 1
        # a slot emits at the first steps of the chunk, until it ends: a prefix of each column
        counts = emitted.sum(axis=0)
        if not np.array_equal(emitted, np.arange(len(emitted))[:, None] < counts):
            raise RuntimeError("a slot emitted after it stopped: decode state is inconsistent")
        counts = counts.tolist()
        tokens, logprobs, active = tokens.T.tolist(), logprobs.T.tolist(), active.tolist()
        for slot, state in enumerate(self._slots):
            if state is None:
                continue
            n = counts[slot]
            for i in range(n):
                still = active[slot] or i < n - 1
                if self._emit(slot, tokens[slot][i], logprobs[slot][i], still, finished):
                    break

    def _emit(
        self, slot: int, token: int, logprob: float, still_active: bool, out: list[Completion]
    ) -> bool:
        """Appends a token to a slot; frees the slot and records the completion when it ends."""
        state = self._slots[slot]
        assert state is not None
        state.tokens.append(token)
        state.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        reason: FinishReason | None = None
        if token in state.stop_set:
            reason = "eos" if token in state.eos else "stop"
        elif state.request.params.stop_strings and self._hits_stop_string(state):
            reason = "stop"
        elif len(state.tokens) >= state.request.params.max_new_tokens:
            reason = "length"
        elif not still_active:  # the device ended it: only stop ids and the budget do that
            raise RuntimeError(f"slot {slot} ended on device without a reason the host knows")
        if reason is None:
            return False
        out.append(Completion(state.request, state.tokens, state.logprobs, reason))
        self._slots[slot] = None
        if still_active:  # ended on the host (stop string): stop the device slot too
            self._state = self._state._replace(active=self._state.active.at[slot].set(False))
        return True

    def _hits_stop_string(self, state: _Slot) -> bool:
        tail = self.policy.tokenizer.decode(state.tokens[-32:], skip_special_tokens=False)
        return any(s in tail for s in state.request.params.stop_strings)
