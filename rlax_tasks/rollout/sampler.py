"""The rollout engine: continuous batching of requests over a preallocated KV cache's slots.

A request's prompt is prefilled into a free slot, then all slots decode together (``kernels``);
when one finishes, the next waiting request takes it while the others keep decoding.
``batching="static"`` instead waits for every slot to be free (the classic baseline)."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

from rlax_tasks.models.kv_cache import cache_shardings, init_cache
from rlax_tasks.models.policy import Policy
from rlax_tasks.models.transformer import resolve_dtype
from rlax_tasks.rollout.held_weights import HeldWeights, held_weights, weights_device
from rlax_tasks.rollout.kernels import (
    DECODE,
    EXTEND,
    PREFILL,
    admission_arrays,
    empty_state,
    request_keys,
)
from rlax_tasks.rollout.precompile import Precompiler
from rlax_tasks.rollout.requests import Completion, FinishReason, Partial, Request, SamplingParams
from rlax_tasks.rollout.shapes import (
    admission_rows,
    decode_window,
    prompt_bucket,
    shared_prompt_rows,
)
from rlax_tasks.utils.validation import check_choice, check_int, field_error


@dataclasses.dataclass
class _Slot:
    request: Request
    tokens: list[int]
    logprobs: list[float]
    stop_set: frozenset[int]
    eos: frozenset[int]
    support: list[list[int]] | None = None  # each token's kept ids, when its request filters
    versions: list[int] | None = None  # each token's weight version, when the weights have one
    # a mixture-of-experts model: each token's experts [L, k] once it was fed back (-1 before)
    routes: list[np.ndarray] | None = None
    prefilled: int = 0  # tokens its admission prefilled


@dataclasses.dataclass
class SamplerStats:
    """Counters for progress lines and benchmarks."""

    prefill_calls: int = 0
    decode_calls: int = 0
    generated_tokens: int = 0
    completions: int = 0
    prefilled_tokens: int = 0  # prompt tokens computed by admissions (extensions included)
    extended_tokens: int = 0  # of those, behind a kept cache (an episode's next turn)
    evicted: int = 0  # kept caches given up for a waiting request
    prefill_s: float = 0.0
    decode_s: float = 0.0
    last_swap_s: float | None = None


class Sampler:
    """KV-cache sampler with continuous batching over ``max_slots`` slots of ``max_len`` tokens.

    ``generate`` is the one-call API; ``add_request`` / ``step`` / ``abort`` drive it step by
    step; ``interrupt`` sends the requests in flight back to the queue with their tokens, to
    continue on the weights set next (their prefix prefilled again). ``decode_chunk``: decode
    steps per device call (8: the tiny preset's completions in one); ``precompile``: a serving
    sampler's ``Precompiler`` (off for a fixed workload, e.g. an evaluation: it repeats its own
    sizes, and the compiles would only take a core from the run beside it); ``layer_copies``:
    decode reads each layer's weights as arrays of their own (``held_weights``: a second copy
    of the layers in memory; false, on an accelerator, it reads slices of the stacked ones)."""

    def __init__(
        self,
        policy: Policy,
        max_slots: int = 32,
        max_len: int = 2048,
        *,
        decode_chunk: int = 8,
        batching: Literal["continuous", "static"] = "continuous",
        max_stop_ids: int = 8,
        precompile: bool = False,
        support_capacity: int = 0,
        layer_copies: bool = True,
    ) -> None:
        error = field_error(ValueError)
        check_int("max_slots", max_slots, error, minimum=1)
        check_int("max_len", max_len, error, minimum=2)
        check_int("decode_chunk", decode_chunk, error, minimum=1)
        check_int("support_capacity", support_capacity, error, minimum=0)
        # ids kept per token by a request's top-k/top-p, recorded for the trainer (0: none)
        self.support_capacity = support_capacity
        check_choice("batching", batching, ("continuous", "static"), error)
        # committed placement, as set_params makes it: a swap then never changes the jit cache key
        self.policy = policy.with_params(
            jax.device_put(policy.params, jax.tree.map(lambda a: a.sharding, policy.params))
        )
        # the weights' buffers are the sampler's own only once set_params placed them: before
        # that they may be the caller's, which an in-place reload must not free
        self._owns_params = False
        # decode's own copies of the weights (``held_weights``; ``layer_copies``: the layers')
        self.layer_copies = bool(layer_copies)
        self._held = held_weights(self.policy, self.layer_copies)
        # read from the model's configs once: every request looks them up
        self._eos_ids = frozenset(self.policy.eos_token_ids)
        # a mixture-of-experts model records each token's experts per layer (docs/design.md
        # §14): (layers, k), and a token's entry before it is fed back
        c = self.policy.config
        self.route_shape = (c.num_hidden_layers, c.num_experts_per_tok) if c.is_moe else (0, 0)
        self._unrouted = np.full(self.route_shape, -1, np.int16) if c.is_moe else None
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
            place = jax.sharding.SingleDeviceSharding(weights_device(self.policy))
            cache_place = jax.tree.map(lambda _: place, cache)
        self._cache = jax.jit(
            lambda: init_cache(policy.config, max_slots, max_len, dtype), out_shardings=cache_place
        )()
        self._state = jax.device_put(empty_state(max_slots, max_stop_ids), place)
        self._slots: list[_Slot | None] = [None] * max_slots
        self._waiting: collections.deque[Request | Partial] = collections.deque()
        # turns that ended on a stop id with ``keep_cache``: request id -> (slot, cached ids),
        # oldest first (the first given up when a waiting request needs a slot)
        self._kept: collections.OrderedDict[Any, tuple[int, tuple[int, ...]]] = (
            collections.OrderedDict()
        )
        self.version: int | None = None  # of the weights (set_params): each token records it
        self._prefill_fn = PREFILL
        self._decode_fn = DECODE
        self._precompiler = Precompiler(self, enabled=precompile)

    # ------------------------------------------------------------------ weights
    @property
    def params(self) -> nnx.State:
        return self.policy.params

    def set_params(
        self, params: nnx.State, *, donate: bool = False, version: int | None = None
    ) -> float:
        """Swaps in new weights of the same shapes (no recompilation); returns the seconds taken.
        ``interrupt`` or ``abort`` first: a request left in flight would go on with its prefix's
        cache from the old weights. After the first swap each old array is freed before its
        replacement is placed: never two full copies. ``donate``: device arrays already in the
        sampler's dtype and placement are taken over (freed at the next swap): the caller must
        not use them again. ``version``: what each token sampled with them records."""
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
        self._held = held_weights(self.policy, self.layer_copies)
        self.version = version
        self.stats.last_swap_s = time.perf_counter() - t0
        return self.stats.last_swap_s

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queues one request; validates it first (ValueError naming the problem)."""
        self.validate(request)
        self._waiting.append(request)

    def add_partial(self, partial: Partial) -> None:
        """Queues a request to continue from its tokens so far (a record handed back after a
        preemption): its prompt and tokens are prefilled, and it draws on from the same random
        stream, as after ``interrupt``."""
        self.validate(partial.request)
        budget = partial.request.params.max_new_tokens
        if len(partial.tokens) >= budget:
            raise ValueError(
                f"request {partial.request.request_id!r}: {len(partial.tokens)} tokens so far "
                f"leave nothing to generate (max_new_tokens {budget})"
            )
        self.check_token_ids(partial.tokens, f"request {partial.request.request_id!r}: token")
        self._waiting.append(partial)

    def in_progress(self) -> list[Partial]:
        """Copies of what the unfinished requests hold so far (those in flight, and those sent
        back by ``interrupt`` or ``add_partial`` and not admitted yet); nothing changes."""
        held = [w for w in self._waiting if isinstance(w, Partial)]
        held += [
            Partial(
                s.request,
                s.tokens,
                s.logprobs,
                s.support,
                s.versions,
                self._stacked_routes(s.routes),
            )  # fmt: skip
            for s in self._slots
            if s is not None
        ]
        return [
            Partial(
                p.request,
                list(p.tokens),
                list(p.logprobs),
                None if p.support is None else [list(k) for k in p.support],
                None if p.versions is None else list(p.versions),
                None if p.routed_experts is None else p.routed_experts.copy(),
            )
            for p in held
        ]

    def check_token_ids(self, ids: Sequence[int], what: str) -> None:
        """ValueError "<what> ids must lie in [0, vocab)" unless every id in ``ids`` does."""
        vocab = self.policy.config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise ValueError(f"{what} ids must lie in [0, {vocab})")

    def validate(self, request: Request) -> None:
        """Raises ValueError naming what is wrong with a request for this sampler."""
        request.params.validate(self.policy.config.vocab_size)
        n = len(request.prompt)
        if n == 0:
            raise ValueError(f"request {request.request_id!r}: the prompt is empty")
        self.check_token_ids(request.prompt, f"request {request.request_id!r}: prompt token")
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

    def release(self, request_id: Any) -> None:
        """Gives up the cache a finished ``keep_cache`` turn kept (its episode ended)."""
        self._kept.pop(request_id, None)

    @property
    def kept_caches(self) -> int:
        """Slots holding a finished turn's cache for its next turn."""
        return len(self._kept)

    def _free(self) -> list[int]:
        """Slots neither decoding nor keeping a turn's cache."""
        kept = {slot for slot, _ in self._kept.values()}
        return [i for i, s in enumerate(self._slots) if s is None and i not in kept]

    @property
    def has_unfinished(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slots)

    @property
    def num_active(self) -> int:
        return sum(s is not None for s in self._slots)

    def abort(self) -> list[Request]:
        """Drops every waiting and in-flight request (their partial output is discarded)."""
        waiting = [w.request if isinstance(w, Partial) else w for w in self._waiting]
        dropped = waiting + [s.request for s in self._slots if s is not None]
        self._waiting.clear()
        self._free_slots()
        return dropped

    def interrupt(self) -> int:
        """Sends every request in flight back to the front of the queue as a ``Partial`` (its
        tokens, log-probs, kept ids and versions so far, in slot order): admitted again, its
        prompt and tokens are prefilled under the weights of then and it draws on from the
        same random stream. Returns how many were in flight."""
        partials = [
            Partial(
                s.request,
                s.tokens,
                s.logprobs,
                s.support,
                s.versions,
                self._stacked_routes(s.routes),
            )  # fmt: skip
            for s in self._slots
            if s is not None
        ]
        self._waiting.extendleft(reversed(partials))
        self._free_slots()
        return len(partials)

    def _free_slots(self) -> None:
        """Every slot free, on the device too (kept caches given up: their weights may go)."""
        self._slots = [None] * self.max_slots
        self._kept.clear()
        # placed like the rest of the state: an uncommitted array here made the next prefill
        # and decode compile a second program for every admission shape (once per reload)
        active = jax.device_put(np.zeros(self.max_slots, bool), self._state.active.sharding)
        self._state = self._state._replace(active=active)

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

    def _fill_settings(
        self, new: Any, requests: list[Request]
    ) -> tuple[list[frozenset[int]], bool, bool]:
        """Fills an admission's first rows of ``new`` (``SlotState``) with the requests'
        budgets, sampling settings, stop ids and keys; returns their stop sets and whether any
        filters (top-k/top-p) or samples (temperature > 0): the call's static flags."""
        n, params = len(requests), [r.params for r in requests]
        new.budget[:n] = [p.max_new_tokens for p in params]
        new.temperature[:n] = [p.temperature for p in params]
        new.top_k[:n] = [p.top_k for p in params]
        new.top_p[:n] = [p.top_p for p in params]
        stop_sets = self._stop_sets(params)
        for row, stops in enumerate(stop_sets):
            new.stop_ids[row, : len(stops)] = sorted(stops)
        new.key[:n] = request_keys([p.seed for p in params], [r.sample_index for r in requests])
        filtering = any(p.filtering for p in params)
        sampling = any(p.temperature > 0 for p in params)
        return stop_sets, filtering, sampling

    def _admit(self, finished: list[Completion]) -> None:
        if self._kept and self._waiting:
            self._admit_continued(finished)
        free = self._free()
        if self._waiting and len(free) < len(self._waiting) and self._kept:
            # a turn waiting on its tool leaves the batch: its cache is given up for a
            # waiting request (its next turn prefills its whole history instead)
            for _ in range(min(len(self._waiting) - len(free), len(self._kept))):
                self._kept.popitem(last=False)
                self.stats.evicted += 1
            free = self._free()
        if not self._waiting or not free:
            return
        if self.batching == "static" and len(free) < self.max_slots:
            return
        items = [self._waiting.popleft() for _ in range(min(len(free), len(self._waiting)))]
        take = [w.request if isinstance(w, Partial) else w for w in items]
        # what each row prefills: its prompt, and a continued request's tokens so far
        prefixes = [
            tuple(w.request.prompt) + tuple(w.tokens) if isinstance(w, Partial) else tuple(w.prompt)
            for w in items
        ]
        rows = admission_rows(len(take), self.max_slots)
        bucket = prompt_bucket(max(len(p) for p in prefixes), self.max_len)
        # equal prompts (a group's G samples) are prefilled once: rows -> their prompt's row
        prompt_of: dict[tuple[int, ...], int] = {}
        rows_prompt = [prompt_of.setdefault(prefix, len(prompt_of)) for prefix in prefixes]
        prompt_rows = shared_prompt_rows(rows, len(prompt_of), self.max_slots)
        ids, lengths, source, slots, new = admission_arrays(
            rows, bucket, prompt_rows, self.max_slots, self.max_stop_ids
        )
        # filled column by column: an admission can hold hundreds of requests
        n = len(take)
        if source is None:
            prompts = prefixes
        else:
            prompts = list(prompt_of)
            source[:n] = rows_prompt
        filled = len(prompts)
        lengths[:filled] = [len(prompt) for prompt in prompts]
        ids[:filled][np.arange(bucket) < lengths[:filled, None]] = [
            t for prompt in prompts for t in prompt
        ]
        slots[:n] = free[:n]
        new.generated[:n] = [len(w.tokens) if isinstance(w, Partial) else 0 for w in items]
        stop_sets, filtering, sampling = self._fill_settings(new, take)
        group = n // len(prompts)  # requests per distinct prompt
        self._precompiler.admitted(rows, prompt_rows, bucket, filtering, sampling, group)
        t0 = time.perf_counter()
        with self.policy._scope():
            self._cache, self._state, tokens, logprobs, active, kept = self._prefill_fn(
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
                self.support_size(filtering),
            )
            tokens, logprobs, active, kept = jax.device_get((tokens, logprobs, active, kept))
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.prefill_calls += 1
        self.stats.prefilled_tokens += sum(len(p) for p in prefixes)
        self._place(items, free[:n], [len(p) for p in prefixes], stop_sets,
                    (tokens, logprobs, active, kept), finished)  # fmt: skip

    def _place(
        self,
        items: list[Request | Partial],
        slots: list[int],
        prefilled: list[int],
        stop_sets: list[frozenset[int]],
        drawn: tuple[np.ndarray, ...],
        finished: list[Completion],
    ) -> None:
        """Puts an admission's rows in their slots and emits each one's first token (``drawn``:
        the call's tokens, log-probs, active flags and kept ids, padding rows after them)."""
        n = len(items)
        tokens, logprobs, active, kept = drawn
        tokens, logprobs, active = tokens[:n].tolist(), logprobs[:n].tolist(), active[:n].tolist()
        kept = kept[:n]
        rows_out = zip(items, slots, prefilled, stop_sets, tokens, logprobs, active, kept,
                       strict=True)  # fmt: skip
        for item, slot, count, stops, token, logprob, still, ids in rows_out:
            self._slots[slot] = self._slot(item, stops, bool(kept.shape[-1]))
            self._slots[slot].prefilled = count
            self._emit(slot, token, logprob, still, finished, ids)

    def _admit_continued(self, finished: list[Completion]) -> None:
        """Admits the waiting turns whose episode's cache is kept: each prefills only its new
        tokens (an observation) behind that cache, in its own slot, in one call."""
        take: list[tuple[Request, int, int]] = []  # (request, slot, cached length)
        rest: collections.deque[Request | Partial] = collections.deque()
        top_start = top_new = 0
        for item in self._waiting:
            kept = None if isinstance(item, Partial) else self._kept.get(item.continues)
            if kept is None or len(take) == self.max_slots:
                rest.append(item)
                continue
            slot, cached = kept
            if item.prompt[: len(cached)] != cached or len(item.prompt) == len(cached):
                self._kept.pop(item.continues)  # not its prefix: prefilled whole instead
                rest.append(item)
                continue
            start, extra = max(top_start, len(cached)), max(top_new, len(item.prompt) - len(cached))
            if extra > self.max_len - start:  # no one width fits the call: the next one
                rest.append(item)
                continue
            top_start, top_new = start, extra
            take.append((item, slot, len(cached)))
            del self._kept[item.continues]
        if not take:
            return
        self._waiting = rest
        n = len(take)
        rows = admission_rows(n, self.max_slots)
        width = min(prompt_bucket(top_new, self.max_len), self.max_len - top_start)
        ids, lengths, _, slots, new = admission_arrays(
            rows, width, None, self.max_slots, self.max_stop_ids
        )
        starts = np.zeros(rows, np.int32)
        for row, (request, slot, cached) in enumerate(take):
            extra = request.prompt[cached:]
            ids[row, : len(extra)] = extra
            lengths[row], starts[row], slots[row] = len(extra), cached, slot
        stop_sets, filtering, sampling = self._fill_settings(new, [r for r, _, _ in take])
        t0 = time.perf_counter()
        with self.policy._scope():
            self._cache, self._state, *drawn = EXTEND(
                self.policy.graphdef,
                self.policy.params,
                self._held,
                self._cache,
                self._state,
                ids,
                lengths,
                starts,
                slots,
                new,
                filtering,
                sampling,
                self.support_size(filtering),
            )
            drawn = jax.device_get(tuple(drawn))
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.prefill_calls += 1
        counts = [int(x) for x in lengths[:n]]
        self.stats.prefilled_tokens += sum(counts)
        self.stats.extended_tokens += sum(counts)
        self._place([r for r, _, _ in take], [slot for _, slot, _ in take], counts, stop_sets,
                    tuple(drawn), finished)  # fmt: skip

    def _slot(self, item: Request | Partial, stops: frozenset[int], recording: bool) -> _Slot:
        """A slot's host state for an admitted request, or a continued one with its tokens so
        far (``recording``: the call records kept ids)."""
        request = item.request if isinstance(item, Partial) else item
        eos = frozenset() if request.params.ignore_eos else self._eos_ids
        support = [] if recording and request.params.filtering else None
        versions = None if self.version is None else []
        routes = None if self._unrouted is None else []
        if not isinstance(item, Partial):
            return _Slot(request, [], [], stops, eos, support, versions, routes)
        if support is not None:
            support = list(item.support or [[]] * len(item.tokens))
        if versions is not None:
            versions = list(item.versions or [self.version] * len(item.tokens))
        if routes is not None:  # (the last one, fed again by this prefill, stays unrecorded)
            recorded = item.routed_experts
            routes = [self._unrouted] * len(item.tokens) if recorded is None else list(recorded)
        return _Slot(request, list(item.tokens), list(item.logprobs), stops, eos, support,
                     versions, routes)  # fmt: skip

    def _stacked_routes(self, routes: list[np.ndarray] | None) -> np.ndarray | None:
        """A slot's per-token routes as one [tokens, L, k] int16 array (None: a dense model)."""
        if routes is None:
            return None
        return np.stack(routes) if routes else np.zeros((0, *self.route_shape), np.int16)

    def support_size(self, filtering: bool) -> int:
        """Kept ids recorded per token by a prefill or decode call (static): the capacity when
        a request in it filters, else none."""
        return self.support_capacity if filtering else 0

    def stop_precompiling(self) -> None:
        """Background compilations end after the one under way (a worker that stops)."""
        self._precompiler.stop()

    def wait_precompiled(self, timeout_s: float | None = None) -> None:
        """Waits for the background compilations started so far (tests, benchmarks)."""
        self._precompiler.wait(timeout_s)

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
        self._precompiler.decoding(window, reach, filtering, sampling)
        t0 = time.perf_counter()
        with self.policy._scope():
            self._cache, self._state, tokens, logprobs, emitted, kept, routes = self._decode_fn(
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
                self.support_size(filtering),
                self.route_shape,
            )
            tokens, logprobs, emitted, active, kept, routes = jax.device_get(
                (tokens, logprobs, emitted, self._state.active, kept, routes)
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
                if state.routes is not None:  # step i fed the slot's last token: its route
                    state.routes[-1] = routes[i, slot]
                still = active[slot] or i < n - 1
                ids = kept[i, slot]
                if self._emit(slot, tokens[slot][i], logprobs[slot][i], still, finished, ids):
                    break

    def _emit(
        self,
        slot: int,
        token: int,
        logprob: float,
        still_active: bool,
        out: list[Completion],
        kept: np.ndarray,
    ) -> bool:
        """Appends a token (and the ids its filter ``kept``) to a slot; frees the slot and records
        the completion when it ends."""
        state = self._slots[slot]
        assert state is not None
        state.tokens.append(token)
        state.logprobs.append(logprob)
        if state.support is not None:
            state.support.append(kept[kept >= 0].tolist())
        if state.versions is not None:
            state.versions.append(self.version)
        if state.routes is not None:
            state.routes.append(self._unrouted)
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
        out.append(
            Completion(
                state.request,
                state.tokens,
                state.logprobs,
                reason,
                state.support,
                state.versions,
                routed_experts=self._stacked_routes(state.routes),
                prefilled=state.prefilled,
            )
        )
        self._slots[slot] = None
        if state.request.keep_cache and token in state.stop_set and self.batching == "continuous":
            # the device stopped it too: the cache holds its prompt and every token but the last
            cached = state.request.prompt + tuple(state.tokens[:-1])
            self._kept[state.request.request_id] = (slot, cached)
        if still_active:  # ended on the host (stop string): stop the device slot too
            self._state = self._state._replace(active=self._state.active.at[slot].set(False))
        return True

    def _hits_stop_string(self, state: _Slot) -> bool:
        tail = self.policy.tokenizer.decode(state.tokens[-32:], skip_special_tokens=False)
        return any(s in tail for s in state.request.params.stop_strings)
