"""One sampler slot's host state: the request it serves and what it generated so far (each
token's log-prob, kept ids, weight version and experts), handed back as a ``Partial`` or a
``Completion``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from rlax_tasks.rollout.requests import Completion, FinishReason, Partial, Request


@dataclasses.dataclass
class Slot:
    """A slot's request and its tokens so far; the optional lists are recorded only when asked
    for (``support``: its filter filters; ``versions``: the weights have one; ``routes``: a
    mixture-of-experts model, each token's experts [L, k] once it was fed back, -1 before)."""

    request: Request
    tokens: list[int]
    logprobs: list[float]
    stop_set: frozenset[int]
    eos: frozenset[int]
    support: list[list[int]] | None = None
    versions: list[int] | None = None
    routes: list[np.ndarray] | None = None
    prefilled: int = 0  # tokens its admission prefilled

    @classmethod
    def admit(
        cls,
        item: Request | Partial,
        stops: frozenset[int],
        eos_ids: frozenset[int],
        recording: bool,
        version: int | None,
        unrouted: np.ndarray | None,
    ) -> Slot:
        """The state of an admitted request, or of a continued one with its tokens so far
        (``recording``: the call records kept ids; ``unrouted``: a token's routes before it
        is fed back, None for a dense model)."""
        request = item.request if isinstance(item, Partial) else item
        eos = frozenset() if request.params.ignore_eos else eos_ids
        support = [] if recording and request.params.filtering else None
        versions = None if version is None else []
        routes = None if unrouted is None else []
        if not isinstance(item, Partial):
            return cls(request, [], [], stops, eos, support, versions, routes)
        if support is not None:
            support = list(item.support or [[]] * len(item.tokens))
        if versions is not None:
            versions = list(item.versions or [version] * len(item.tokens))
        if routes is not None:  # (the last one, fed again by this prefill, stays unrecorded)
            recorded = item.routed_experts
            routes = [unrouted] * len(item.tokens) if recorded is None else list(recorded)
        return cls(request, list(item.tokens), list(item.logprobs), stops, eos, support,
                   versions, routes)  # fmt: skip

    def append(
        self,
        token: int,
        logprob: float,
        kept: np.ndarray,
        version: int | None,
        unrouted: np.ndarray | None,
    ) -> None:
        """Records one sampled token (``kept``: the ids its filter kept, -1 padded)."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.support is not None:
            self.support.append(kept[kept >= 0].tolist())
        if self.versions is not None:
            self.versions.append(version)
        if self.routes is not None:
            self.routes.append(unrouted)

    def finish_reason(self, tokenizer: Any) -> FinishReason | None:
        """Why the slot ends after its last token, or None while it goes on: a stop id (an end
        id: "eos"), a stop string in its decoded tail (``tokenizer``), or its budget."""
        token, params = self.tokens[-1], self.request.params
        if token in self.stop_set:
            return "eos" if token in self.eos else "stop"
        if params.stop_strings:
            tail = tokenizer.decode(self.tokens[-32:], skip_special_tokens=False)
            if any(s in tail for s in params.stop_strings):
                return "stop"
        return "length" if len(self.tokens) >= params.max_new_tokens else None

    def partial(self, route_shape: tuple[int, int]) -> Partial:
        """What the slot holds so far, as a record to continue from (lists shared, not copied)."""
        return Partial(self.request, self.tokens, self.logprobs, self.support, self.versions,
                       stacked_routes(self.routes, route_shape))  # fmt: skip

    def completion(self, reason: FinishReason, route_shape: tuple[int, int]) -> Completion:
        """The finished request."""
        return Completion(
            self.request,
            self.tokens,
            self.logprobs,
            reason,
            self.support,
            self.versions,
            routed_experts=stacked_routes(self.routes, route_shape),
            prefilled=self.prefilled,
        )


def route_layout(config: Any) -> tuple[tuple[int, int], np.ndarray | None]:
    """A model's per-token routes (docs/design.md §14): their shape (layers, k), (0, 0) for a
    dense model, and a token's entry before it is fed back (-1s; None for a dense model)."""
    if not config.is_moe:
        return (0, 0), None
    shape = (config.num_hidden_layers, config.num_experts_per_tok)
    return shape, np.full(shape, -1, np.int16)


def stacked_routes(
    routes: list[np.ndarray] | None, route_shape: tuple[int, int]
) -> np.ndarray | None:
    """A slot's per-token routes as one [tokens, L, k] int16 array (None: a dense model)."""
    if routes is None:
        return None
    return np.stack(routes) if routes else np.zeros((0, *route_shape), np.int16)


def copy_partial(p: Partial) -> Partial:
    """A copy of ``p`` that shares no list or array with it."""
    return Partial(
        p.request,
        list(p.tokens),
        list(p.logprobs),
        None if p.support is None else [list(k) for k in p.support],
        None if p.versions is None else list(p.versions),
        None if p.routed_experts is None else p.routed_experts.copy(),
    )
