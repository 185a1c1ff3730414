"""How far the sampler's log-probs sit from the policy's own forward pass (docs/design.md §5)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def forward_logprob_gaps(
    policy: Any, prompts: Sequence[list[int]], outs: Sequence[Any]
) -> np.ndarray:
    """|sampler log-prob − forward log-prob| of every generated token, prompt by prompt."""
    gaps = []
    for prompt, out in zip(prompts, outs, strict=False):
        ids = np.array(prompt + out.tokens)[None]
        forward = np.asarray(policy.token_logprobs(ids))[0, len(prompt) :]
        gaps.append(np.abs(forward - np.array(out.logprobs)))
    return np.concatenate(gaps)
