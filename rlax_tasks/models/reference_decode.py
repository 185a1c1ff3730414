"""Greedy decoding without a KV cache: a slow, obviously-correct reference for the sampler."""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rlax_tasks.models import forward
from rlax_tasks.models.policy import Policy

log = logging.getLogger(__name__)


@functools.partial(jax.jit, static_argnums=0)
def _next_tokens(graphdef, params, ids, mask, last):  # noqa: ANN001, ANN202
    lg = forward.logits(graphdef, params, ids, mask)
    return jnp.argmax(jnp.take_along_axis(lg, last[:, None, None], axis=1)[:, 0], axis=-1)


def greedy_decode(
    policy: Policy,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int] | None = None,
) -> list[list[int]]:
    """Greedy completions (prompt excluded, stop token included) by re-running the full forward.

    Shapes are fixed ([B, max_prompt + max_new_tokens]) so the step compiles once.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    stop = set(policy.eos_token_ids if stop_ids is None else stop_ids)
    b, p = len(prompts), max(len(x) for x in prompts)
    ids = np.zeros((b, p + max_new_tokens), np.int32)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, p - len(prompt) : p] = prompt
        mask[row, p - len(prompt) : p] = 1
    out: list[list[int]] = [[] for _ in range(b)]
    done = np.zeros(b, bool)
    for step in range(max_new_tokens):
        last = np.full(b, p + step - 1, np.int32)
        nxt = np.asarray(_next_tokens(policy.graphdef, policy.params, ids, mask, last))
        for row in np.flatnonzero(~done):
            out[row].append(int(nxt[row]))
            done[row] = int(nxt[row]) in stop
        ids[:, p + step] = nxt
        mask[:, p + step] = 1
        if done.all():
            break
    return out
