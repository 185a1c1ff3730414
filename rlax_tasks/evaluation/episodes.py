"""Multi-turn evaluation (docs/design.md §15): each dataset row an episode of the run's
environment, with its tools and chat template, scored by the environment as in training; what
`rlax eval --environment-from` and the DAGs' held-out evaluations of a tool run sample with."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from rlax_tasks.rewards.scoring import SampleScore
from rlax_tasks.utils.progress_meter import ProgressMeter

logger = logging.getLogger(__name__)


def episode_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The row each dataset row's episode resets from: its prompt and what scores it (the
    answer, else the code tests), as training's prompt mixture gives it."""
    rows = []
    for prompt, answer, tests in zip(frame["prompt"], frame["answer"], frame["tests"], strict=True):
        rows.append({"prompt": prompt, "answer": answer} if answer is not None
                    else {"prompt": prompt, "tests": tests})  # fmt: skip
    return rows


def load_environment(config_path: str) -> Any:
    """``eval.dataset.environment`` of the run config at ``config_path`` (a run's config.yaml);
    ValueError naming the field when the config has none."""
    from rlax_tasks.config import load_config  # lazy: `rlax` builds every parser at start-up

    cfg = load_config(config_path)
    spec = cfg.eval.dataset
    if spec is None or spec.environment is None:
        raise ValueError(
            f"--environment-from {config_path}: eval.dataset.environment is not set there; give "
            "a run config whose held-out dataset names an environment, or leave the flag out"
        )
    return spec.environment


@dataclasses.dataclass
class EpisodeGenerator:
    """``n`` episodes of ``environment`` per row, sampled from ``policy``: (the episode's text,
    its turns and observations, and the environment's score) per episode; ``unusable`` screens
    rows first."""

    policy: Any
    environment: Any
    max_new_tokens: int = 256
    temperature: float = 1.0
    seed: int = 0
    max_slots: int = 32
    max_len: int = 2048
    stop: tuple[str, ...] = ()
    _sampler: Any = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_len <= self.max_new_tokens:
            raise ValueError(
                f"max_len ({self.max_len}) must exceed max_new_tokens ({self.max_new_tokens})"
            )

    def unusable(self, rows: Sequence[Mapping[str, Any]]) -> list[str | None]:
        """Per row, why its episode cannot start (the environment refuses it, or its first
        messages leave no room for a turn), None when it can."""
        from rlax_tasks.rollout.episodes import episode_prompt  # lazy: JAX

        limit = self.max_len - self.max_new_tokens
        reasons: list[str | None] = []
        for row in rows:
            try:
                n = len(episode_prompt(self.policy.tokenizer, self.environment, row))
            except ValueError as e:
                reasons.append(f"the environment cannot start it: {e}")
                continue
            reasons.append(
                f"its episode's prompt has {n} tokens, more than {limit} (max_len - max_new_tokens)"
                if n > limit
                else None
            )
        return reasons

    def __call__(
        self, rows: Sequence[Mapping[str, Any]], n: int
    ) -> list[list[tuple[str, SampleScore]]]:
        from rlax_tasks.rollout import Sampler, per_prompt_params  # lazy: JAX
        from rlax_tasks.rollout.episodes import run_episodes

        if self._sampler is None:
            self._sampler = Sampler(self.policy, max_slots=self.max_slots, max_len=self.max_len)
        params = per_prompt_params(
            self.seed,
            len(rows),
            max_new_tokens=self.max_new_tokens,
            temperature=float(self.temperature),
            stop_strings=tuple(self.stop),
        )
        meter = ProgressMeter("episodes", len(rows) * n, logger=logger, unit="episodes")
        with meter:
            groups = run_episodes(self._sampler, self.environment, list(rows), n, params,
                                  on_done=lambda _: meter.update())  # fmt: skip
        decode = self.policy.tokenizer.decode
        out = []
        for comps in groups:
            scored = []
            for c in comps:
                reward = float(c.reward or 0.0)
                text = decode(c.tokens, skip_special_tokens=True)
                scored.append((text, SampleScore(reward, "correct" if reward > 0 else "incorrect")))
            out.append(scored)
        return out
