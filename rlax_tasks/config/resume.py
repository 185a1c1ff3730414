"""Saving the resolved configuration, and what a resume may change (config_changes.jsonl).

``save_resolved`` writes run_root/<run_id>/config.yaml. Over an existing one (a resume) it
refuses changed training settings (``ConfigChangeError``) unless allowed, and records every
change with the step it applies after."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Mapping
from typing import Any

import yaml

from rlax_tasks.config.checks import plain
from rlax_tasks.config.schema import RunConfig
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

# Which settings a resume may change. A resume that changes one that alters what is trained
# (the model and its precision, datasets, prompt rendering, the objective, staleness, sampling
# and batch sizes, the optimizer and its schedule, seeds, where checkpoints live, which prompts
# fit workers.max_len) is refused unless allowed; evaluation, placement, the worker fleet, the
# compilation cache and how the trainer computes the same step (micro-batches, remat, buckets,
# mesh, hosts, checkpoint cadence) change freely. The longest matching dotted prefix decides;
# a setting not listed changes training.
_CHANGES_TRAINING: dict[str, bool] = {
    "": True,
    "run_root": False, "run_id": False, "compilation_cache": False,
    "eval": False, "placement": False,
    "workers": False, "workers.max_len": True,
    "model.warmup_if_missing": False, "model.import_if_missing": False,
    "trainer.micro_batch_size": False, "trainer.remat": False, "trainer.length_bucket": False,
    "trainer.logprob_chunk_size": False, "trainer.keep_logits_mb": False,
    "trainer.pack_sequences": False,
    "trainer.mesh_shape": False, "trainer.hosts": False,
    "trainer.checkpoint_every": False, "trainer.max_to_keep": False,
    "trainer.async_checkpointing": False,
}  # fmt: skip


class _Unset:
    """A setting absent from one side of a comparison."""

    def __repr__(self) -> str:
        return "(unset)"


_UNSET: Any = _Unset()


@dataclasses.dataclass(frozen=True)
class ConfigChange:
    """One setting that differs from the run's saved config.yaml."""

    field: str
    old: Any
    new: Any
    changes_training: bool

    def format(self) -> str:
        """``trainer.learning_rate 0.0003 → 1000000000.0``."""
        return f"{self.field} {_show(self.old)} → {_show(self.new)}"


class ConfigChangeError(ValueError):
    """A resume would change settings that alter training; ``changes`` lists them."""

    def __init__(self, run_dir: str, changes: list[ConfigChange], step: int) -> None:
        self.changes = changes
        listed = ", ".join(c.format() for c in changes)
        super().__init__(
            f"run {run_dir} was started with other training settings: {listed}. A resume "
            "keeps them: use another run_id for a new run, or allow the change (rlax run "
            f"--allow-config-change, the training DAG's allow_config_change) to apply it after "
            f"step {step}"
        )


def _show(value: Any) -> str:
    if value is _UNSET:
        return repr(value)
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("\n...")


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaves of a plain config dict; lists of sections are indexed (datasets[0].name),
    lists of values are leaves; an empty section has no leaves."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(value, list | tuple) and any(isinstance(v, Mapping) for v in value):
        out = {}
        for i, v in enumerate(value):
            out.update(_flat(v, f"{prefix}[{i}]"))
        return out
    return {prefix: value}


def _changes_training(field: str) -> bool:
    key = re.sub(r"\[\d+\]", "", field)
    while key not in _CHANGES_TRAINING:
        key = key.rpartition(".")[0]
    return _CHANGES_TRAINING[key]


def config_changes(old: Mapping[str, Any], new: RunConfig) -> list[ConfigChange]:
    """The settings of ``new`` that differ from ``old`` (a saved config.yaml's mapping)."""
    try:  # the old file through today's schema: defaults added since then are no change
        before = _flat(RunConfig.from_dict(old).to_dict())
    except (ValueError, TypeError):
        before = _flat(plain(old))
    after = _flat(new.to_dict())
    return [
        ConfigChange(f, before.get(f, _UNSET), after.get(f, _UNSET), _changes_training(f))
        for f in sorted(before.keys() | after.keys())
        if before.get(f, _UNSET) != after.get(f, _UNSET)
    ]


def _trained_step(run_dir: str) -> int:
    """The last step in run_dir/metrics.jsonl (0 before the first): where a change applies."""
    rows = storage.read_jsonl(run_paths(run_dir).metrics)  # local or gs://
    return next((int(r["step"]) for r in reversed(rows) if "step" in r), 0)


def save_resolved(config: RunConfig, allow_config_change: bool = False) -> str:
    """Writes run_root/<run_id>/config.yaml (local or gs://); returns its path.

    On a resume, settings that change training (``_CHANGES_TRAINING``) must be unchanged, else
    ``ConfigChangeError`` (nothing written) unless ``allow_config_change``; accepted changes go
    to config_changes.jsonl with the step they apply after (the run's last trained step)."""
    paths = run_paths(config.run_dir)
    text = config.to_yaml()
    changes: list[ConfigChange] = []
    if storage.exists(paths.config):
        raw = yaml.safe_load(storage.read_bytes(paths.config)) or {}
        changes = config_changes(raw if isinstance(raw, Mapping) else {}, config)
    if changes:
        step = _trained_step(config.run_dir)
        training = [c for c in changes if c.changes_training]
        if training and not allow_config_change:
            raise ConfigChangeError(config.run_dir, training, step)
        now = time.time()
        lines = "".join(
            json.dumps({"field": c.field, "old": None if c.old is _UNSET else c.old,
                        "new": None if c.new is _UNSET else c.new, "step": step,
                        "changes_training": c.changes_training, "time": now}) + "\n"
            for c in changes
        )  # fmt: skip
        old_lines = (
            storage.read_bytes(paths.config_changes) if storage.exists(paths.config_changes)
            else b""
        )  # fmt: skip
        storage.write_bytes(paths.config_changes, old_lines + lines.encode())
    storage.write_bytes(paths.config, text.encode())
    return paths.config
