"""The run configuration as validated data: one frozen dataclass per section, loaded from YAML.

``load_config("tiny-arith", overrides)`` gives a ``RunConfig``; every error is a ``ConfigError``
naming the dotted field. schema.py holds RunConfig, sections.py and datasets.py its sections,
placement.py the hardware rules, loading.py presets and YAML, resume.py saving and resumes."""

from __future__ import annotations

from rlax_tasks.config.checks import ConfigError
from rlax_tasks.config.datasets import DatasetSpec, FileSource, SyntheticSource
from rlax_tasks.config.loading import load_config, merge_overrides, preset_names
from rlax_tasks.config.placement import PlacementSettings
from rlax_tasks.config.resume import (
    ConfigChange,
    ConfigChangeError,
    config_changes,
    save_resolved,
)
from rlax_tasks.config.schema import RunConfig
from rlax_tasks.config.sections import (
    AlgorithmSettings,
    EvalSettings,
    ModelSettings,
    RolloutSettings,
    StalenessSettings,
    WorkerSettings,
)
from rlax_tasks.data.prompts import PromptSettings

__all__ = [
    "AlgorithmSettings",
    "ConfigChange",
    "ConfigChangeError",
    "ConfigError",
    "DatasetSpec",
    "EvalSettings",
    "FileSource",
    "ModelSettings",
    "PlacementSettings",
    "PromptSettings",
    "RolloutSettings",
    "RunConfig",
    "StalenessSettings",
    "SyntheticSource",
    "WorkerSettings",
    "config_changes",
    "load_config",
    "merge_overrides",
    "preset_names",
    "save_resolved",
]
