"""A scorer's answer as a ``ScoredGroup``: rewards parsed robustly (a verifier's failure scores
0 with the verdict "verifier_error") and DAPO's overlong shaping added when it is on."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from rlax_tasks.algorithms import overlong_penalty
from rlax_tasks.controller.buffer import ScoredGroup, support_tuples, version_tuple
from rlax_tasks.controller.mixture import Prompt
from rlax_tasks.controller.settings import ControllerSettings
from rlax_tasks.rollout.requests import GroupResult
from rlax_tasks.rollout.routes import record_of

log = logging.getLogger(__name__)


def finite_or_none(value: Any) -> float | None:
    """``value`` as a finite float; None for a null, a NaN or infinity, or a non-number (robust
    parsing of what a verifier or worker sent)."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def reward_and_verdict(score: Any) -> tuple[float, str]:
    """A ``Scorer``'s score as (reward, verdict): a bare reward (any real number, numpy's
    too) has the verdict ""; a reward that is null or not a finite number (a verifier's
    failure) scores 0 with the verdict "verifier_error"."""
    if isinstance(score, numbers.Real) or score is None:
        reward, verdict = score, ""
    else:
        reward, verdict = getattr(score, "reward", None), str(getattr(score, "verdict", ""))
    value = finite_or_none(reward)
    if value is None:
        log.warning("a verifier's reward %r is not a finite number: scored 0", reward)
        return 0.0, "verifier_error"
    return value, verdict


def scored_group(
    prompt: Prompt, result: GroupResult, raw: Sequence[Any], settings: ControllerSettings
) -> ScoredGroup:
    """The group of ``result`` with its scores ``raw`` (one per completion), ready to buffer."""
    s = settings
    comps = result.completions
    if len(raw) != len(comps):
        raise RuntimeError(f"{prompt.id}: {len(raw)} scores for {len(comps)} completions")
    scores, verdicts = zip(*(reward_and_verdict(x) for x in raw), strict=True)
    rewards = np.asarray(scores, dtype=np.float64)
    if s.overlong_cache_len is not None:
        lengths = np.array([len(c.tokens) for c in comps])
        rewards = rewards + overlong_penalty(
            lengths, s.sampling.max_new_tokens, s.overlong_cache_len, s.overlong_factor
        )
    recorded = any(c.versions is not None for c in comps)
    token_versions = tuple(version_tuple(c.versions) for c in comps) if recorded else ()
    # staleness is judged by the oldest token, whatever the group says
    oldest = min([result.version, *(min(v) for v in token_versions if v)])
    return ScoredGroup(
        prompt_id=prompt.id,
        seq=prompt.seq,
        version=oldest,
        prompt_tokens=tuple(result.prompt_tokens),
        completions=tuple(tuple(int(t) for t in c.tokens) for c in comps),
        # (a null log-prob arrives as NaN: the trainer stops on a non-finite loss, naming it)
        logprobs=tuple(tuple(_float(x) for x in c.logprobs) for c in comps),
        finish_reasons=tuple(c.finish_reason for c in comps),
        scores=tuple(scores),
        rewards=tuple(float(x) for x in rewards),
        verdicts=tuple(verdicts) if any(verdicts) else (),
        support=tuple(support_tuples(c.support) for c in comps)
        if any(c.support is not None for c in comps)
        else (),
        token_versions=token_versions,
        resumed=tuple(c.resumed for c in comps) if any(c.resumed for c in comps) else (),
        routed_experts=tuple(record_of(c.routed_experts) for c in comps)
        if any(c.routed_experts is not None for c in comps)
        else (),
        loss_masks=tuple(None if c.mask is None else tuple(int(m) for m in c.mask) for c in comps)
        if any(c.mask is not None for c in comps)
        else (),
        episodes=tuple(episode_counters(c.episode) for c in comps)
        if any(c.episode is not None for c in comps)
        else (),
    )


EPISODE_COUNTERS = ("turns", "tool_calls", "valid_calls", "tool_errors", "tool_seconds",
                    "step_timeouts", "masked_tokens")  # fmt: skip


def episode_counters(episode: Any) -> dict[str, float] | None:
    """An episode's counters from a worker's report (its history is not kept: the tokens
    hold it); None for a completion that is no episode."""
    if not isinstance(episode, dict):
        return None
    stats = episode.get("stats") if isinstance(episode.get("stats"), dict) else {}
    merged = {**stats, **{k: v for k, v in episode.items() if k != "stats"}}
    return {k: finite_or_none(merged.get(k)) or 0.0 for k in EPISODE_COUNTERS}


def environment_scores(result: GroupResult) -> list[float] | None:
    """The rewards an episode group's environment gave (None: a group the scorer scores)."""
    rewards = [c.reward for c in result.completions]
    return None if any(r is None for r in rewards) else [float(r) for r in rewards]


def _float(value: Any) -> float:
    """``float(value)``, NaN for a null (robust parsing of a worker's answer)."""
    return float("nan") if value is None else float(value)
