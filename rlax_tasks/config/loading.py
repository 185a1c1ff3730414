"""Loading a run configuration: a preset shipped in rlax_tasks/presets/ or a YAML file.

``load_config("tiny-arith", {"staleness.max_staleness": 2})`` reads the preset (or a local or
gs:// YAML path), applies the overrides (dotted keys or nested dicts) and validates.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from importlib import resources
from typing import Any

import yaml

from rlax_tasks.config.checks import ConfigError
from rlax_tasks.config.schema import RunConfig
from rlax_tasks.presets import preset_names  # (re-exported: the presets' one list)
from rlax_tasks.rundir import storage
from rlax_tasks.utils import validation

PRESET_PACKAGE = "rlax_tasks.presets"


def _read_yaml(path_or_preset: str) -> tuple[dict[str, Any], str]:
    """(raw mapping, default run id) of a preset name or a YAML file (local or gs://)."""
    if path_or_preset in preset_names():
        text = resources.files(PRESET_PACKAGE).joinpath(f"{path_or_preset}.yaml").read_text()
        origin, stem = f"preset {path_or_preset!r}", path_or_preset
    elif path_or_preset.endswith((".yaml", ".yml")) or os.sep in path_or_preset:
        if not storage.is_gcs(path_or_preset) and not os.path.isfile(path_or_preset):
            raise FileNotFoundError(f"config file {path_or_preset} does not exist")
        text = storage.read_bytes(path_or_preset).decode()
        origin = path_or_preset
        stem = os.path.splitext(os.path.basename(path_or_preset))[0]
    else:
        names = preset_names()
        raise ConfigError(
            "preset",
            f"unknown preset {path_or_preset!r}{validation.did_you_mean(path_or_preset, names)}; "
            f"presets: {', '.join(names)} (or give a path to a .yaml file)",
        )
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("", f"{origin} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError("", f"{origin} must hold a mapping of settings")
    return raw, stem


def _apply_override(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Sets ``raw[a][b]... = value`` for ``dotted`` = "a.b..." (intermediate dicts created)."""
    parts = dotted.split(".")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), f"is not a section; cannot set {dotted}")
        node = child
    node[parts[-1]] = copy.deepcopy(value)


def merge_overrides(raw: dict[str, Any], overrides: Mapping[str, Any], prefix: str = "") -> dict:
    """``raw`` with ``overrides`` applied: dotted keys or nested dicts; lists replace whole."""
    out = copy.deepcopy(raw)
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and not (
            dotted.endswith("overrides") or dotted.endswith("knobs")
        ):
            node = out
            for part in dotted.split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if isinstance(node, dict):
                out = merge_overrides(out, value, prefix=dotted + ".")
                continue
        _apply_override(out, dotted, value)
    return out


def load_config(path_or_preset: str, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """The validated run configuration of a preset name or YAML file, with ``overrides``.

    ``run_id`` defaults to the preset name / file stem, so running the same command again
    resumes the same run.
    """
    raw, stem = _read_yaml(path_or_preset)
    raw = merge_overrides(raw, overrides or {})
    raw.setdefault("run_id", stem)
    return RunConfig.from_dict(raw)
