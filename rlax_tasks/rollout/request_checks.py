"""What a request must satisfy for a sampler of given sizes: ValueErrors that name the request
and the limit it passes (a user's mistake, caught before anything is queued)."""

from __future__ import annotations

from collections.abc import Sequence

from rlax_tasks.rollout.admission import stop_set
from rlax_tasks.rollout.requests import Partial, Request


def check_token_ids(ids: Sequence[int], vocab: int, what: str) -> None:
    """ValueError "<what> ids must lie in [0, vocab)" unless every id in ``ids`` does."""
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise ValueError(f"{what} ids must lie in [0, {vocab})")


def check_request(
    request: Request,
    *,
    vocab: int,
    max_len: int,
    max_stop_ids: int,
    eos_ids: frozenset[int],
    tokenizer: bool,
) -> None:
    """ValueError naming what is wrong with ``request`` for a sampler of ``max_len`` entries a
    slot and ``max_stop_ids`` stop ids (``tokenizer``: the policy has one, for stop strings)."""
    request.params.validate(vocab)
    n, rid = len(request.prompt), request.request_id
    if n == 0:
        raise ValueError(f"request {rid!r}: the prompt is empty")
    check_token_ids(request.prompt, vocab, f"request {rid!r}: prompt token")
    if n + request.params.max_new_tokens > max_len:
        raise ValueError(
            f"request {rid!r}: prompt ({n} tokens) + max_new_tokens "
            f"({request.params.max_new_tokens}) exceeds the sampler's max_len {max_len}"
        )
    if len(stop_set(request.params, eos_ids)) > max_stop_ids:
        raise ValueError(f"request {rid!r}: more than {max_stop_ids} stop token ids")
    if request.params.stop_strings and not tokenizer:
        raise ValueError("stop_strings need a tokenizer; the policy has none")


def check_partial(partial: Partial, vocab: int) -> None:
    """ValueError unless ``partial``'s tokens so far leave something to generate and lie in the
    vocabulary (its request is checked with ``check_request``)."""
    rid, budget = partial.request.request_id, partial.request.params.max_new_tokens
    if len(partial.tokens) >= budget:
        raise ValueError(
            f"request {rid!r}: {len(partial.tokens)} tokens so far leave nothing to generate "
            f"(max_new_tokens {budget})"
        )
    check_token_ids(partial.tokens, vocab, f"request {rid!r}: token")
