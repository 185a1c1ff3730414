"""pass@k (the unbiased estimator of Chen et al., 2021) and maj@k (majority voting)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n samples,
    c of them correct, is correct: 1 - C(n-c, k) / C(n, k), computed as
    1 - prod_{i=n-c+1}^{n} (1 - k/i) in log space (stable for large n)."""
    n, c, k = _check_int("n", n), _check_int("c", c), _check_int("k", k)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ValueError(f"c must lie in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ValueError(f"k must lie in [1, n={n}], got {k}")
    if n - c < k:  # every k-subset contains a correct sample
        return 1.0
    if c == 0:
        return 0.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(-np.expm1(np.sum(np.log1p(-k / i))))


def mean_pass_at_k(n: int, correct: Sequence[int], k: int) -> float:
    """pass@k averaged over prompts, each with n samples of which correct[p] are correct."""
    if len(correct) == 0:
        raise ValueError("mean_pass_at_k needs at least one prompt")
    return math.fsum(pass_at_k(n, int(c), k) for c in correct) / len(correct)


def majority_answer(answers: Sequence[str | None]) -> int | None:
    """Index of the first sample holding the most frequent non-None answer (ties: the answer
    seen first wins), or None when no sample has an answer."""
    counts = Counter(a for a in answers if a is not None)
    if not counts:
        return None
    best = max(counts.values())
    for i, a in enumerate(answers):
        if a is not None and counts[a] == best:
            return i
    raise AssertionError("unreachable")  # pragma: no cover


def maj_at_k(answers: Sequence[str | None], rewards: Sequence[float], k: int) -> float:
    """maj@k for one prompt: majority vote over the first k samples' extracted answers
    (None = no answer, not a vote); the reward of the winning answer (0.0 without votes)."""
    k = _check_int("k", k)
    if len(answers) != len(rewards):
        raise ValueError(
            f"answers and rewards must have the same length, got {len(answers)} and {len(rewards)}"
        )
    if not 1 <= k <= len(answers):
        raise ValueError(f"k must lie in [1, {len(answers)}], got {k}")
    winner = majority_answer(answers[:k])
    return 0.0 if winner is None else float(rewards[winner])
