"""Evaluating a policy on a dataset: n samples per prompt, pass@k for several k, maj@k, mean
reward, and the same broken down per source and per difficulty."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from rlax_tasks.evaluation.episodes import EpisodeGenerator, episode_rows
from rlax_tasks.evaluation.generation import GenerateFn
from rlax_tasks.evaluation.metrics import maj_at_k, pass_at_k
from rlax_tasks.rewards.scoring import score_completions
from rlax_tasks.utils.progress_meter import ProgressMeter

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """n samples per prompt; pass@k and maj@k for each k in `ks` (each 1 <= k <= n)."""

    n: int = 8
    ks: tuple[int, ...] = (1, 8)
    limit: int | None = None
    batch_size: int = 256

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not self.ks:
            raise ValueError("ks: give at least one k")
        bad = [k for k in self.ks if not 1 <= k <= self.n]
        if bad:
            raise ValueError(f"k must lie in [1, n={self.n}], got {bad}")
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")


def difficulty_of(metadata: dict[str, Any]) -> str:
    """The difficulty bucket of a row: metadata "difficulty" or "level", else its recorded
    pass rate in quarters, else "unknown"."""
    for key in ("difficulty", "level"):
        value = metadata.get(key)
        if value is not None and not isinstance(value, dict | list):
            return f"{key} {value}" if key == "level" else str(value)
    rate = metadata.get("pass_rate")
    if isinstance(rate, int | float) and not isinstance(rate, bool) and rate == rate:
        lo = min(int(rate * 4), 3) / 4
        return f"pass_rate [{lo:.2f}, {lo + 0.25:.2f}{']' if lo == 0.75 else ')'}"
    return "unknown"


def _summary(rows: list[dict], ks: Sequence[int], n: int) -> dict[str, Any]:
    out: dict[str, Any] = {"prompts": len(rows)}
    for k in ks:
        out[f"pass@{k}"] = math.fsum(pass_at_k(n, r["correct"], k) for r in rows) / len(rows)
    voting = [r for r in rows if r["has_answer"]]
    out["maj_prompts"] = len(voting)
    for k in ks:
        out[f"maj@{k}"] = (
            math.fsum(maj_at_k(r["answers"], r["rewards"], k) for r in voting) / len(voting)
            if voting
            else None
        )
    out["mean_reward"] = float(np.mean([np.mean(r["rewards"]) for r in rows]))
    return out


@dataclasses.dataclass
class EvalResult:
    """Per-prompt outcomes and the metrics over them (overall, per source, per difficulty)."""

    name: str
    config: EvalConfig
    rows: list[dict]
    overall: dict[str, Any]
    by_source: dict[str, dict[str, Any]]
    by_difficulty: dict[str, dict[str, Any]]
    # rows that could not be sampled (e.g. a prompt longer than max_len): id and reason
    skipped: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "n": self.config.n,
            "ks": list(self.config.ks),
            "overall": self.overall,
            "by_source": self.by_source,
            "by_difficulty": self.by_difficulty,
            "skipped": self.skipped,
        }


def evaluate(
    frame: pd.DataFrame,
    generate: GenerateFn | EpisodeGenerator,
    config: EvalConfig,
    name: str = "model",
    unusable: Callable[[Sequence[Any]], list[str | None]] | None = None,
) -> EvalResult:
    """Samples `config.n` completions per row with `generate`, scores them, and aggregates;
    rows `unusable` names a reason for (a prompt too long to sample) are skipped and listed.
    An `EpisodeGenerator` runs each row as an episode of its environment instead, which scores
    it (and screens the rows itself). Logs prompts done / total, ETA and the mean reward so far
    every few seconds."""
    rows: list[dict] = []
    skipped: list[dict[str, Any]] = []
    episodes = generate if isinstance(generate, EpisodeGenerator) else None
    if episodes is not None:
        unusable = lambda _: episodes.unusable(episode_rows(frame))  # noqa: E731
    if unusable is not None:
        reasons = unusable(frame["prompt"].tolist())
        bad = [i for i, r in enumerate(reasons) if r is not None]
        skipped = [{"id": _row_id(frame, i), "reason": reasons[i]} for i in bad]
        if bad:
            logger.warning(
                "%s: %d of %d prompts skipped; first: %s", name, len(bad), len(frame),
                skipped[0]["reason"],
            )  # fmt: skip
            frame = frame.drop(index=frame.index[bad]).reset_index(drop=True)
    if len(frame) == 0:
        raise ValueError(f"{name}: no prompt can be sampled ({skipped[0]['reason']})")
    prompts = frame["prompt"].tolist()
    answers = frame["answer"].tolist()
    tests = frame["tests"].tolist()
    meter = ProgressMeter(f"eval {name}", len(frame), logger=logger, unit="prompts")
    reward_sum = 0.0
    for lo in range(0, len(frame), config.batch_size):
        hi = min(lo + config.batch_size, len(frame))
        if episodes is not None:  # scored by their environment, as in training
            scored = episodes(episode_rows(frame.iloc[lo:hi]), config.n)
            completions = [[text for text, _ in row] for row in scored]
            scores = [[score for _, score in row] for row in scored]
        else:
            completions = generate(prompts[lo:hi], config.n)
        if len(completions) != hi - lo or any(len(c) != config.n for c in completions):
            raise RuntimeError(f"generator returned a wrong number of completions (n={config.n})")
        if episodes is None:
            scores = score_completions(answers[lo:hi], tests[lo:hi], completions)
        for i, (comps, row_scores) in enumerate(zip(completions, scores, strict=True)):
            r = lo + i
            meta = frame["metadata"].iat[r]
            rewards = [s.reward for s in row_scores]
            rows.append(
                {
                    "id": _row_id(frame, r),
                    "source": frame["source"].iat[r] or "(no source)",
                    "difficulty": difficulty_of(meta),
                    # an episode's answer is not extracted: no maj@k vote
                    "has_answer": answers[r] is not None and episodes is None,
                    "correct": int(sum(x > 0 for x in rewards)),
                    "rewards": rewards,
                    "answers": [s.answer for s in row_scores],
                    "verdicts": [s.verdict for s in row_scores],
                    "completions": comps,
                }
            )
            reward_sum += float(np.mean(rewards))
        meter.update(hi - lo, reward=reward_sum / hi)
    meter.finish(reward=reward_sum / len(frame))
    groups: dict[str, dict[str, list[dict]]] = {
        "source": defaultdict(list),
        "difficulty": defaultdict(list),
    }
    for r in rows:
        groups["source"][r["source"]].append(r)
        groups["difficulty"][r["difficulty"]].append(r)
    overall = _summary(rows, config.ks, config.n)
    overall["skipped"] = len(skipped)
    return EvalResult(
        name,
        config,
        rows,
        overall,
        {s: _summary(rs, config.ks, config.n) for s, rs in sorted(groups["source"].items())},
        {d: _summary(rs, config.ks, config.n) for d, rs in sorted(groups["difficulty"].items())},
        skipped,
    )


def _row_id(frame: pd.DataFrame, r: int) -> str:
    if "id" in frame.columns and frame["id"].iat[r] is not None:
        return str(frame["id"].iat[r])
    return f"{frame['origin_file'].iat[r]}:{frame['origin_row'].iat[r]}"
