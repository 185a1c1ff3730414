"""RL objectives (docs/design.md §4): composable Agg / IS / Adv / GradTerm components, algorithm
presets (``make_objective``), dynamic sampling and DAPO overlong reward shaping."""

from __future__ import annotations

from rlax_tasks.utils.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "BatchError": ".objective",
        "Objective": ".objective",
        "ObjectiveConfig": ".config",
        "ObjectiveConfigError": ".config",
        "PRESETS": ".config",
        "filter_groups": ".dynamic_sampling",
        "make_objective": ".objective",
        "overlong_penalty": ".reward_shaping",
        "preset_config": ".config",
    },
)
