"""What an environment is (docs/design.md §15): the ``Environment`` protocol, the ``StepResult`` of
one turn, and the ``EnvironmentSpec`` that ``datasets[].environment`` holds in the run config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from rlax_tasks.config.checks import ConfigError, set_field
from rlax_tasks.config.environment import EnvironmentSpec
from rlax_tasks.environments import registry
from rlax_tasks.utils import validation


@dataclasses.dataclass(frozen=True)
class StepResult:
    """The environment's answer to one assistant turn.

    Args:
      messages: the observation, chat messages (role "tool" or "user") that follow the turn.
      done: the episode ended with this turn.
      reward: the episode's reward when ``done`` (a partial score otherwise, or 0).
      info: per-step numbers; a tool environment's hold ``tool_calls`` (calls attempted),
        ``valid_calls`` (well-formed ones), ``tool_errors`` (calls that gave an error
        observation) and ``tool_seconds`` (time spent running tools).
    """

    messages: tuple[dict, ...]
    done: bool
    reward: float = 0.0
    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        set_field(self, "messages", tuple(self.messages))


@runtime_checkable
class Environment(Protocol):
    """A multi-turn task: ``reset(row)`` gives the first messages, ``step(turn)`` answers each
    assistant turn. State beyond the transcript must be rebuilt by ``reset(row)`` alone, so that a
    resumed episode replays its turns; the caller enforces ``max_turns``."""

    tools: list[dict]  # function schemas {"type": "function", "function": {...}}; [] for none

    def reset(self, row: dict) -> list[dict]:
        """Start an episode on a dataset row; returns its first chat messages."""
        ...

    def step(self, turn: str) -> StepResult:
        """Answer one assistant turn (its text, special tokens stripped)."""
        ...


def check_environment(spec: EnvironmentSpec) -> None:
    """ConfigError naming ``name`` unless ``spec``'s environment is registered (or installed)."""
    name = spec.name
    names = registry.environment_names()
    if name not in names:
        raise ConfigError(
            "name",
            f"unknown environment {name!r}{validation.did_you_mean(name, names)}; registered: "
            f"{', '.join(names)} (a package adds one through the entry point group "
            f"{registry.ENTRY_POINT_GROUP!r})",
        )
