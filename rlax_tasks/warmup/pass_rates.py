"""Held-out pass@k of a policy on compact arithmetic problems, sampled with the real Sampler."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from rlax_tasks.evaluation import mean_pass_at_k
from rlax_tasks.models import Policy
from rlax_tasks.rewards.tasks import Problem
from rlax_tasks.rollout import Sampler, per_prompt_params
from rlax_tasks.utils.progress_meter import ProgressMeter
from rlax_tasks.warmup.tiny_arith import TinyArith

log = logging.getLogger(__name__)


def evaluate_pass_rates(
    policy: Policy,
    problems: Sequence[Problem],
    n: int,
    k_list: Sequence[int],
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    *,
    seed: int = 0,
    task_format: TinyArith | None = None,
    sampler: Sampler | None = None,
    max_slots: int = 64,
) -> dict[str, Any]:
    """Unbiased pass@k (Chen et al. 2021) over ``problems`` from n samples each.

    Returns {"pass@k": float for k in k_list, "num_prompts", "num_samples", "mean_reward",
    "seconds"}. ``sampler`` (reusing its compiled shapes) is used as is when given; its
    weights must be the policy's. Each k must lie in [1, n]."""
    if not problems:
        raise ValueError("evaluate_pass_rates needs at least one problem")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    bad = [k for k in k_list if not 1 <= k <= n]
    if bad or not k_list:
        raise ValueError(f"k_list must be non-empty with every k in [1, n={n}], got {list(k_list)}")
    if policy.tokenizer is None:
        raise ValueError("the policy has no tokenizer: save one next to its config.json")
    fmt = task_format or TinyArith()
    t0 = time.perf_counter()
    prompts = [fmt.encode_prompt(policy.tokenizer, p) for p in problems]
    if sampler is None:
        longest = max(len(p) for p in prompts) + max_new_tokens
        sampler = Sampler(policy, max_slots=max_slots, max_len=max(16, longest))
    # a seed per prompt: samples of different prompts are independent
    params = per_prompt_params(
        seed, len(prompts), max_new_tokens=max_new_tokens, temperature=float(temperature)
    )
    meter = ProgressMeter("pass rates", len(prompts) * n, logger=log, unit="samples")
    outs = sampler.generate(prompts, n=n, params=params, on_complete=lambda _: meter.update())
    meter.finish()
    result = score_pass_rates(fmt, policy.tokenizer, problems, [o.tokens for o in outs], n, k_list)
    result.update(num_prompts=len(problems), num_samples=n, seconds=time.perf_counter() - t0)
    return result


def score_pass_rates(
    fmt: TinyArith,
    tokenizer: Any,
    problems: Sequence[Problem],
    completions: Sequence[Sequence[int]],
    n: int,
    k_list: Sequence[int],
) -> dict[str, Any]:
    """{"pass@k" for k in k_list, "mean_reward"} of ``n`` completions (token ids) per problem,
    problem-major, scored by the task format (whichever sampler produced them)."""
    expanded = [p for p in problems for _ in range(n)]
    rewards = fmt.score_completions(tokenizer, expanded, completions)
    correct = [int(sum(rewards[i * n : (i + 1) * n])) for i in range(len(problems))]
    result: dict[str, Any] = {f"pass@{k}": mean_pass_at_k(n, correct, k) for k in k_list}
    result["mean_reward"] = sum(rewards) / len(rewards)
    return result
