"""RL objectives (DESIGN §4): composable Agg / IS / Adv / GradTerm components, algorithm
presets (``make_objective``), dynamic sampling and DAPO overlong reward shaping."""

from rlax_tasks.algorithms.config import (
    PRESETS,
    ObjectiveConfig,
    ObjectiveConfigError,
    preset_config,
)
from rlax_tasks.algorithms.dynamic_sampling import filter_groups
from rlax_tasks.algorithms.objective import BatchError, Objective, make_objective
from rlax_tasks.algorithms.reward_shaping import overlong_penalty

__all__ = [
    "PRESETS",
    "BatchError",
    "Objective",
    "ObjectiveConfig",
    "ObjectiveConfigError",
    "filter_groups",
    "make_objective",
    "overlong_penalty",
    "preset_config",
]
