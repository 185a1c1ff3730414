"""The rollout engine: continuous batching of requests over a preallocated KV cache's slots.

A request's prompt is prefilled into a free slot, then all slots decode together (``kernels``);
when one finishes, the next waiting request takes it while the others keep decoding.
``batching="static"`` instead waits for every slot to be free (the classic baseline)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx

from rlax_tasks.models.policy import Policy
from rlax_tasks.rollout.admission import (
    KeptCaches,
    fill_settings,
    pack,
    pack_continued,
    take_continued,
)
from rlax_tasks.rollout.held_weights import HeldWeights, held_weights
from rlax_tasks.rollout.kernels import DECODE, EXTEND, PREFILL
from rlax_tasks.rollout.precompile import Precompiler
from rlax_tasks.rollout.request_checks import check_partial, check_request, check_token_ids
from rlax_tasks.rollout.requests import Completion, Partial, Request, SamplingParams
from rlax_tasks.rollout.sampler_stats import SamplerStats  # (importable from here)
from rlax_tasks.rollout.shapes import decode_window
from rlax_tasks.rollout.slot_cache import init_slot_cache
from rlax_tasks.rollout.slots import Slot, copy_partial, route_layout
from rlax_tasks.rollout.weight_swap import check_same_layout, place_like
from rlax_tasks.utils.validation import check_choice, check_int, field_error


class Sampler:
    """KV-cache sampler with continuous batching over ``max_slots`` slots of ``max_len`` tokens.

    ``generate`` is the one-call API; ``add_request`` / ``step`` / ``abort`` drive it step by
    step; ``interrupt`` sends the requests in flight back to the queue with their tokens, to
    continue on the weights set next (their prefix prefilled again).

    Args:
      policy: the model, its weights and tokenizer (a mesh shards the cache too).
      max_slots: requests decoded together.
      max_len: cache entries per slot: a request's prompt plus its new tokens.
      decode_chunk: decode steps per device call (8: the tiny preset's completions in one).
      batching: "continuous" refills a slot as soon as it frees; "static" waits for all.
      max_stop_ids: stop ids a request may have (the model's end ids included).
      precompile: a serving sampler's ``Precompiler`` (off for a fixed workload, e.g. an
        evaluation: it repeats its own sizes, and the compiles would take a core from the run).
      support_capacity: ids kept per token by a request's top-k/top-p, recorded for the
        trainer (0: none).
      layer_copies: decode reads each layer's weights as arrays of their own
        (``held_weights``: a second copy of the layers; false, on an accelerator, it reads
        slices of the stacked ones).
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
        precompile: bool = False,
        support_capacity: int = 0,
        layer_copies: bool = True,
    ) -> None:
        error = field_error(ValueError)
        check_int("max_slots", max_slots, error, minimum=1)
        check_int("max_len", max_len, error, minimum=2)
        check_int("decode_chunk", decode_chunk, error, minimum=1)
        check_int("support_capacity", support_capacity, error, minimum=0)
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
        self.route_shape, self._unrouted = route_layout(self.policy.config)
        self.max_slots, self.max_len = max_slots, max_len
        self.decode_chunk, self.batching = decode_chunk, batching
        self.max_stop_ids = max_stop_ids
        self.stats = SamplerStats()
        self._cache, self._state = init_slot_cache(self.policy, max_slots, max_len, max_stop_ids)
        self._slots: list[Slot | None] = [None] * max_slots
        self._waiting: collections.deque[Request | Partial] = collections.deque()
        # turns that ended on a stop id with ``keep_cache``: request id -> (slot, cached ids),
        # oldest first (the first given up when a waiting request needs a slot)
        self._kept: KeptCaches = collections.OrderedDict()
        self.version: int | None = None  # of the weights (set_params): each token records it
        self._prefill_fn, self._decode_fn = PREFILL, DECODE
        self._precompiler = Precompiler(self, enabled=precompile)

    # ------------------------------------------------------------------ weights
    @property
    def params(self) -> nnx.State:
        return self.policy.params

    def set_params(
        self, params: nnx.State, *, donate: bool = False, version: int | None = None
    ) -> float:
        """Swaps in new weights of the same shapes (no recompilation); ``interrupt`` or
        ``abort`` first: a request left in flight would go on with its prefix's cache from the
        old weights. After the first swap each old array is freed before its replacement is
        placed: never two full copies.

        Args:
          params: the new weights (host or device arrays), shaped as the policy's.
          donate: device arrays already in the sampler's dtype and placement are taken over
            (freed at the next swap): the caller must not use them again.
          version: what each token sampled with them records.

        Returns:
          The seconds the swap took.
        """
        t0 = time.perf_counter()
        check_same_layout(self.policy.params, params)
        # the copies are freed first: never two of them beside two weights
        self._held.delete()
        self._held = HeldWeights(None, None)
        placed = place_like(self.policy.params, params, free_old=self._owns_params, donate=donate)
        self.policy = self.policy.with_params(placed)
        self._owns_params = True
        self._held = held_weights(self.policy, self.layer_copies)
        self.version = version
        self.stats.last_swap_s = time.perf_counter() - t0
        return self.stats.last_swap_s

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        """Queues one request.

        Args:
          request: its prompt and sampling settings.

        Raises:
          ValueError: naming what is wrong with it for this sampler (``validate``).
        """
        self.validate(request)
        self._waiting.append(request)

    def add_partial(self, partial: Partial) -> None:
        """Queues a request to continue from its tokens so far: its prompt and tokens are
        prefilled, and it draws on from the same random stream, as after ``interrupt``.

        Args:
          partial: a record handed back after a preemption (or by ``in_progress``).

        Raises:
          ValueError: its request is invalid, or its tokens leave nothing to generate.
        """
        self.validate(partial.request)
        check_partial(partial, self.policy.config.vocab_size)
        self._waiting.append(partial)

    def in_progress(self) -> list[Partial]:
        """What the unfinished requests hold so far; nothing changes.

        Returns:
          Copies, for those in flight and those sent back by ``interrupt`` or ``add_partial``
          and not admitted yet.
        """
        held = [w for w in self._waiting if isinstance(w, Partial)]
        held += [s.partial(self.route_shape) for s in self._slots if s is not None]
        return [copy_partial(p) for p in held]

    def check_token_ids(self, ids: Sequence[int], what: str) -> None:
        """ValueError "<what> ids must lie in [0, vocab)" unless every id in ``ids`` does."""
        check_token_ids(ids, self.policy.config.vocab_size, what)

    def validate(self, request: Request) -> None:
        """Raises ValueError naming what is wrong with a request for this sampler."""
        check_request(request, vocab=self.policy.config.vocab_size, max_len=self.max_len,
                      max_stop_ids=self.max_stop_ids, eos_ids=self._eos_ids,
                      tokenizer=self.policy.tokenizer is not None)  # fmt: skip

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
        """Whether a request waits or is in flight."""
        return bool(self._waiting) or any(s is not None for s in self._slots)

    @property
    def num_active(self) -> int:
        """Slots decoding a request now."""
        return sum(s is not None for s in self._slots)

    def abort(self) -> list[Request]:
        """Drops every waiting and in-flight request (their partial output is discarded).

        Returns:
          The dropped requests, those waiting first.
        """
        waiting = [w.request if isinstance(w, Partial) else w for w in self._waiting]
        dropped = waiting + [s.request for s in self._slots if s is not None]
        self._waiting.clear()
        self._free_slots()
        return dropped

    def interrupt(self) -> int:
        """Sends every request in flight back to the front of the queue as a ``Partial`` (its
        tokens, log-probs, kept ids and versions so far, in slot order): admitted again, its
        prompt and tokens are prefilled under the weights of then and it draws on from the
        same random stream.

        Returns:
          How many requests were in flight.
        """
        partials = [s.partial(self.route_shape) for s in self._slots if s is not None]
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
        """Admits waiting requests into free slots and runs one decode chunk.

        Returns:
          The requests that finished in it, in the order they did.
        """
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
        """Generates ``n`` completions per prompt on an idle sampler, all or nothing.

        Args:
          prompts: token ids, one sequence per prompt.
          max_new_tokens: the most tokens a completion gets.
          temperature: 0 samples greedily.
          seed: per request: every prompt given the same seed draws the same random numbers;
            pass ``params=per_prompt_params(seed, len(prompts), ...)`` when the prompts'
            samples must be independent (evaluation).
          n: completions per prompt (their sample indices 0..n-1 draw apart).
          top_p: nucleus filter (1.0: off).
          top_k: keep the k likeliest ids (0: off).
          stop_token_ids: ids that end a completion besides the model's end ids.
          stop_strings: text that ends a completion (the policy needs a tokenizer).
          ignore_eos: the model's end ids do not end a completion.
          params: one ``SamplingParams``, or one per prompt: overrides the settings above.
          on_complete: called with each completion as it finishes (progress).

        Returns:
          The completions, prompt-major: prompt i's j-th at ``i * n + j``.

        Raises:
          ValueError: a prompt or setting is invalid (nothing is queued).
          RuntimeError: requests are in flight (``add_request`` / ``step`` drive those).
        """
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
        n, packed = len(take), pack(prefixes, free, self.max_slots, self.max_len, self.max_stop_ids)
        new = packed.new
        new.generated[:n] = [len(w.tokens) if isinstance(w, Partial) else 0 for w in items]
        stop_sets, filtering, sampling = fill_settings(new, take, self._eos_ids)
        self._precompiler.admitted(packed.rows, packed.prompt_rows, packed.bucket, filtering,
                                   sampling, packed.group)  # fmt: skip
        t0 = time.perf_counter()
        with self.policy._scope():
            self._cache, self._state, tokens, logprobs, active, kept = self._prefill_fn(
                self.policy.config,
                self.policy.graphdef,
                self.policy.params,
                self._held,
                self._cache,
                self._state,
                packed.ids,
                packed.lengths,
                packed.source,
                packed.slots,
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
            self._slots[slot] = Slot.admit(item, stops, self._eos_ids, bool(kept.shape[-1]),
                                           self.version, self._unrouted)  # fmt: skip
            self._slots[slot].prefilled = count
            self._emit(slot, token, logprob, still, finished, ids)

    def _admit_continued(self, finished: list[Completion]) -> None:
        """Admits the waiting turns whose episode's cache is kept: each prefills only its new
        tokens (an observation) behind that cache, in its own slot, in one call."""
        take, rest, top_start, top_new = take_continued(
            self._waiting, self._kept, self.max_slots, self.max_len
        )
        if not take:
            return
        self._waiting = rest
        n = len(take)
        ids, lengths, starts, slots, new = pack_continued(
            take, top_start, top_new, self.max_slots, self.max_len, self.max_stop_ids
        )
        stop_sets, filtering, sampling = fill_settings(new, [r for r, _, _ in take], self._eos_ids)
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
        state.append(token, logprob, kept, self.version, self._unrouted)
        self.stats.generated_tokens += 1
        reason = state.finish_reason(self.policy.tokenizer)
        if reason is None and not still_active:  # the device ended it: only stop ids and the
            # budget do that
            raise RuntimeError(f"slot {slot} ended on device without a reason the host knows")
        if reason is None:
            return False
        out.append(state.completion(reason, self.route_shape))
        self._slots[slot] = None
        if state.request.keep_cache and token in state.stop_set and self.batching == "continuous":
            # the device stopped it too: the cache holds its prompt and every token but the last
            cached = state.request.prompt + tuple(state.tokens[:-1])
            self._kept[state.request.request_id] = (slot, cached)
        if still_active:  # ended on the host (stop string): stop the device slot too
            self._state = self._state._replace(active=self._state.active.at[slot].set(False))
        return True
