"""Multi-turn evaluation (docs/design.md §15): each dataset row an episode of the run's
environment, with its tools and chat template, scored by the environment as in training; what
`rlax eval --environment-from` and the DAGs' held-out evaluations of a tool run sample with."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from rlax_tasks.data.prompt_source import episode_row
from rlax_tasks.evaluation.generation import PolicySampling
from rlax_tasks.rewards.scoring import SampleScore
from rlax_tasks.utils.progress_meter import ProgressMeter

logger = logging.getLogger(__name__)


def episode_rows(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """The row each dataset row's episode resets from: its prompt and what scores it (the
    answer, else the code tests), as training's prompt mixture gives it."""
    return [
        episode_row(prompt, answer, "math")
        if answer is not None
        else episode_row(prompt, tests, "code")
        for prompt, answer, tests in zip(
            frame["prompt"], frame["answer"], frame["tests"], strict=True
        )
    ]


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
class EpisodeGenerator(PolicySampling):
    """``n`` episodes of ``environment`` per row, sampled from ``policy``: (the episode's text,
    its turns and observations, and the environment's score) per episode; ``unusable`` screens
    rows first. ``stop``: strings that end a turn besides the model's EOS ids."""

    environment: Any = dataclasses.field(kw_only=True)
    stop: tuple[str, ...] = dataclasses.field(default=(), kw_only=True)

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
        from rlax_tasks.rollout.episodes import run_episodes  # lazy: JAX

        params = self.row_params(len(rows), self.stop)
        meter = ProgressMeter("episodes", len(rows) * n, logger=logger, unit="episodes")
        with meter:
            groups = run_episodes(self.sampler, self.environment, list(rows), n, params,
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
