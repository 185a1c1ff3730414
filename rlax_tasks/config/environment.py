"""A dataset's environment in the run config, ``datasets[].environment`` (docs/design.md §15):
validated here as data; whether its name is registered is checked where environments are made
(``rlax_tasks.environments.check_environment``: the registry sits above the configuration)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rlax_tasks.config.checks import ConfigError, build, check_float, check_int, plain, set_field
from rlax_tasks.utils import validation


@dataclasses.dataclass(frozen=True)
class EnvironmentSpec:
    """A dataset's environment in the run config (``datasets[].environment``).

    Args:
      name: a registered environment (``environment_names()``).
      max_turns: assistant turns an episode may take (>= 1).
      max_tokens: the whole episode's token budget (>= 1), or None for no budget of its own.
      tool_timeout_s: the time one ``step`` may take (> 0).
      max_observation_tokens: an observation longer than this is cut, with a marker (>= 1).
      settings: keyword arguments of the environment's factory.
    """

    name: str
    max_turns: int = 4
    max_tokens: int | None = None
    tool_timeout_s: float = 10.0
    max_observation_tokens: int = 512
    settings: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        validation.check_text("name", self.name, ConfigError)
        check_int(self, "max_turns", low=1)
        check_int(self, "max_tokens", low=1, optional=True)
        check_float(self, "tool_timeout_s", low=0.0, open_low=True)
        check_int(self, "max_observation_tokens", low=1)
        if not isinstance(self.settings, Mapping):
            raise ConfigError("settings", f"must be a mapping, got {self.settings!r}")
        bad = [k for k in self.settings if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            raise ConfigError("settings", f"keys must be keyword-argument names, got {bad[0]!r}")
        set_field(self, "settings", dict(self.settings))

    @classmethod
    def from_dict(cls, raw: Any) -> EnvironmentSpec:
        """A spec from its config mapping (a bare string is ``{name: <string>}``); ConfigError
        names the offending field, and an unknown key lists the valid ones."""
        if isinstance(raw, str):
            raw = {"name": raw}
        return build(cls, raw, "")

    def to_dict(self) -> dict[str, Any]:
        """Plain data for the YAML config; ``from_dict`` reads it back."""
        return plain(self)
