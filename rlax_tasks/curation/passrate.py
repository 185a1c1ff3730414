"""Pass-rate pre-filter: keep prompts the current policy solves sometimes but not always.

k completions per prompt from any ``GenerateFn`` (normally ``PolicyGenerator``) are scored by the
verifiers; the rate c/k is recorded for curricula, and rate 0 (too hard) or 1 (too easy) goes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from rlax_tasks.evaluation.generation import GenerateFn
from rlax_tasks.rewards.scoring import score_completions
from rlax_tasks.utils.progress_meter import ProgressMeter

logger = logging.getLogger(__name__)


def measure_pass_rates(
    prompts: Sequence[str],
    answers: Sequence[str | None],
    tests: Sequence[list | None],
    generate: GenerateFn,
    k: int,
    *,
    unusable: Callable[[Sequence[str]], list[str | None]] | None = None,
    batch_size: int = 256,
    progress: ProgressMeter | None = None,
) -> tuple[list[float | None], list[str | None]]:
    """(rate, reason) per prompt: rate = correct/k (None when not measured); reason is set
    for prompts to drop (rate 0 or 1, or a prompt the generator cannot take). ``progress``
    (else a meter of its own, finished here) counts the prompts done, a batch at a time."""
    if k < 1:
        raise ValueError(f"pass-rate k must be >= 1, got {k}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = len(prompts)
    meter = progress or ProgressMeter("pass-rate filter", n, logger=logger, unit="prompts")
    rates: list[float | None] = [None] * n
    reasons: list[str | None] = [None] * n
    problems = unusable(prompts) if unusable is not None else [None] * n
    usable = []
    for i, problem in enumerate(problems):
        if problem is not None:
            reasons[i] = f"cannot sample from the policy: {problem}"
        else:
            usable.append(i)
    if len(usable) < n:  # counted as done: nothing to sample
        meter.update(n - len(usable))
    for lo in range(0, len(usable), batch_size):
        idx = usable[lo : lo + batch_size]
        completions = generate([prompts[i] for i in idx], k)
        if len(completions) != len(idx) or any(len(c) != k for c in completions):
            raise RuntimeError(f"generator returned a wrong number of completions (k={k})")
        scores = score_completions([answers[i] for i in idx], [tests[i] for i in idx], completions)
        for i, row in zip(idx, scores, strict=True):
            correct = sum(s.reward > 0 for s in row)
            rates[i] = correct / k
            if correct == 0:
                reasons[i] = f"pass rate 0/{k}: the policy never solves it (too hard)"
            elif correct == k:
                reasons[i] = f"pass rate {k}/{k}: the policy always solves it (too easy)"
        meter.update(len(idx))
    if progress is None:
        meter.finish()
    return rates, reasons
