"""Run configuration presets (YAML files loaded by ``rlax_tasks.config.load_config``).

``preset_names`` lists them without loading the run configuration package, so the DAG files'
Params form (parsed by the scheduler) names them too."""

from __future__ import annotations

from importlib import resources


def preset_names() -> list[str]:
    """Names of the presets shipped in rlax_tasks/presets/ (file stems)."""
    root = resources.files(__name__)
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))
