"""What one admission prefills: its rows' prompts packed into the kernel's host arrays, their
sampling settings, and which waiting turns extend an episode's kept cache (docs/design.md §15)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from rlax_tasks.rollout.kernels import admission_arrays, request_keys
from rlax_tasks.rollout.requests import Partial, Request, SamplingParams
from rlax_tasks.rollout.shapes import admission_rows, prompt_bucket, shared_prompt_rows

# a sampler's kept caches: request id -> (slot, cached ids), oldest first
KeptCaches = collections.OrderedDict[Any, tuple[int, tuple[int, ...]]]


def stop_set(p: SamplingParams, eos_ids: frozenset[int]) -> frozenset[int]:
    """The ids that end a request: its stop ids, and the model's end ids unless it ignores them."""
    eos = frozenset() if p.ignore_eos else eos_ids
    return eos | frozenset(p.stop_token_ids)


def fill_settings(
    new: Any, requests: Sequence[Request], eos_ids: frozenset[int]
) -> tuple[list[frozenset[int]], bool, bool]:
    """Fills the first rows of ``new`` (a ``SlotState``) with the requests' budgets, sampling
    settings, stop ids and keys; returns their stop sets and whether any filters (top-k/top-p)
    or samples (temperature > 0): the call's static flags."""
    n, params = len(requests), [r.params for r in requests]
    new.budget[:n] = [p.max_new_tokens for p in params]
    new.temperature[:n] = [p.temperature for p in params]
    new.top_k[:n] = [p.top_k for p in params]
    new.top_p[:n] = [p.top_p for p in params]
    seen: dict[int, frozenset[int]] = {}  # once per settings object: a step's usually share one
    for p in params:
        if id(p) not in seen:
            seen[id(p)] = stop_set(p, eos_ids)
    stop_sets = [seen[id(p)] for p in params]
    for row, stops in enumerate(stop_sets):
        new.stop_ids[row, : len(stops)] = sorted(stops)
    new.key[:n] = request_keys([p.seed for p in params], [r.sample_index for r in requests])
    filtering = any(p.filtering for p in params)
    sampling = any(p.temperature > 0 for p in params)
    return stop_sets, filtering, sampling


@dataclasses.dataclass
class Packed:
    """An admission's host arrays for ``PREFILL`` and the sizes its call compiles for."""

    ids: np.ndarray
    lengths: np.ndarray
    source: np.ndarray | None  # each row's prompt row, when equal prompts share one
    slots: np.ndarray
    new: Any  # the rows' SlotState
    rows: int
    prompt_rows: int | None
    bucket: int
    group: int  # requests per distinct prompt


def pack(
    prefixes: Sequence[tuple[int, ...]],
    free: Sequence[int],
    max_slots: int,
    max_len: int,
    max_stop_ids: int,
) -> Packed:
    """Packs what each admitted row prefills (``prefixes``, one per request, into the slots
    ``free``); equal prompts (a group's G samples) are prefilled once."""
    n = len(prefixes)
    rows = admission_rows(n, max_slots)
    bucket = prompt_bucket(max(len(p) for p in prefixes), max_len)
    prompt_of: dict[tuple[int, ...], int] = {}  # rows -> their prompt's row
    rows_prompt = [prompt_of.setdefault(prefix, len(prompt_of)) for prefix in prefixes]
    prompt_rows = shared_prompt_rows(rows, len(prompt_of), max_slots)
    ids, lengths, source, slots, new = admission_arrays(
        rows, bucket, prompt_rows, max_slots, max_stop_ids
    )
    # filled column by column: an admission can hold hundreds of requests
    if source is None:
        prompts = list(prefixes)
    else:
        prompts = list(prompt_of)
        source[:n] = rows_prompt
    filled = len(prompts)
    lengths[:filled] = [len(prompt) for prompt in prompts]
    ids[:filled][np.arange(bucket) < lengths[:filled, None]] = [
        t for prompt in prompts for t in prompt
    ]
    slots[:n] = free[:n]
    return Packed(ids, lengths, source, slots, new, rows, prompt_rows, bucket, n // len(prompts))


def take_continued(
    waiting: Iterable[Request | Partial],
    kept: KeptCaches,
    max_slots: int,
    max_len: int,
) -> tuple[list[tuple[Request, int, int]], collections.deque[Request | Partial], int, int]:
    """The waiting turns whose episode's cache is kept and can be extended in one call.

    Args:
      waiting: the sampler's queue, front first.
      kept: request id -> (slot, cached ids) of the kept caches; the taken ones, and those that
        are not a turn's prefix (prefilled whole instead), are removed.
      max_slots: rows of one call.
      max_len: cache entries of a slot.

    Returns:
      (request, slot, cached length) of each turn taken, the queue left, and the call's start
      and width: the longest cached prefix and the most new tokens of a row.
    """
    take: list[tuple[Request, int, int]] = []
    rest: collections.deque[Request | Partial] = collections.deque()
    top_start = top_new = 0
    for item in waiting:
        found = None if isinstance(item, Partial) else kept.get(item.continues)
        if found is None or len(take) == max_slots:
            rest.append(item)
            continue
        slot, cached = found
        if item.prompt[: len(cached)] != cached or len(item.prompt) == len(cached):
            kept.pop(item.continues)  # not its prefix: prefilled whole instead
            rest.append(item)
            continue
        start, extra = max(top_start, len(cached)), max(top_new, len(item.prompt) - len(cached))
        if extra > max_len - start:  # no one width fits the call: the next one
            rest.append(item)
            continue
        top_start, top_new = start, extra
        take.append((item, slot, len(cached)))
        del kept[item.continues]
    return take, rest, top_start, top_new


def pack_continued(
    take: Sequence[tuple[Request, int, int]],
    start: int,
    new_tokens: int,
    max_slots: int,
    max_len: int,
    max_stop_ids: int,
) -> tuple[Any, ...]:
    """``EXTEND``'s host arrays for the turns ``take_continued`` took: each row's new tokens
    behind its cached ones, in its own slot (ids, lengths, starts, slots, the rows' state)."""
    rows = admission_rows(len(take), max_slots)
    width = min(prompt_bucket(new_tokens, max_len), max_len - start)
    ids, lengths, _, slots, new = admission_arrays(rows, width, None, max_slots, max_stop_ids)
    starts = np.zeros(rows, np.int32)
    for row, (request, slot, cached) in enumerate(take):
        extra = request.prompt[cached:]
        ids[row, : len(extra)] = extra
        lengths[row], starts[row], slots[row] = len(extra), cached, slot
    return ids, lengths, starts, slots, new
