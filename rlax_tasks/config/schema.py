"""The run configuration: ``RunConfig``, every section together, checked across sections.

``RunConfig.from_dict`` builds and validates (errors name the dotted field, unknown keys are
errors); ``to_yaml`` is the resolved form written to run_root/<run_id>/config.yaml, and
loading it again gives an equal config."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import yaml

from rlax_tasks.algorithms.config import ObjectiveConfig, preset_config
from rlax_tasks.config.checks import (
    NAME_RE,
    ConfigError,
    build,
    check_int,
    check_str,
    plain,
    set_field,
)
from rlax_tasks.config.datasets import DatasetSpec
from rlax_tasks.config.placement import (
    PlacementSettings,
    check_run_placement,
    placement_from,
    resolve_placement,
)
from rlax_tasks.config.sections import (
    AlgorithmSettings,
    EvalSettings,
    ModelSettings,
    ParamServerSettings,
    RolloutSettings,
    StalenessSettings,
    WorkerSettings,
    trainer_from,
)
from rlax_tasks.data.prompts import PromptSettings, PromptSettingsError
from rlax_tasks.rundir import storage
from rlax_tasks.trainer.config import TrainerConfig

# advantages computed relative to the other completions of the same prompt need G >= 2
GROUP_RELATIVE_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "group_batch_norm")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one run needs; the resolved form is written to run_root/<run_id>/config.yaml."""

    run_id: str
    run_root: str
    model: ModelSettings
    datasets: tuple[DatasetSpec, ...]
    seed: int = 0
    algorithm: AlgorithmSettings = AlgorithmSettings()
    staleness: StalenessSettings = StalenessSettings()
    rollout: RolloutSettings = RolloutSettings()
    trainer: TrainerConfig = TrainerConfig()
    workers: WorkerSettings = WorkerSettings()
    # parameter-server replicas (docs/design.md §16)
    paramserver: ParamServerSettings = ParamServerSettings()
    eval: EvalSettings = EvalSettings()
    # how every prompt is rendered: training, held-out evaluation, rlax eval, the DAGs
    # (docs/design.md §11)
    prompt: PromptSettings = PromptSettings()
    # JAX's persistent compilation cache under run_root/jax-cache: a restarted component (or a
    # later run of the same shapes) loads its compiled programs instead of compiling again
    compilation_cache: bool = True
    # which devices each job gets (docs/design.md §12); `placement: disaggregated` is the short form
    placement: PlacementSettings = PlacementSettings()

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not NAME_RE.match(self.run_id):
            raise ConfigError(
                "run_id", f"must be letters, digits, '_', '.', '-', got {self.run_id!r}"
            )
        check_str(self, "run_root")
        check_int(self, "seed")
        if not isinstance(self.compilation_cache, bool):
            raise ConfigError(
                "compilation_cache", f"must be true or false, got {self.compilation_cache!r}"
            )
        if not isinstance(self.datasets, list | tuple) or not self.datasets:
            raise ConfigError("datasets", "give at least one dataset")
        set_field(self, "datasets", tuple(self.datasets))
        names = [d.name for d in self.datasets]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(
                    f"datasets[{i}].name", f"duplicate dataset name {name!r}: names must be unique"
                )
        set_field(self, "placement", placement_from(self.placement))
        resolve_placement(self)
        self._cross_checks()
        check_run_placement(self)

    def _cross_checks(self) -> None:
        r, w = self.rollout, self.workers
        objective = self.algorithm.objective_config()
        if r.group_size < 2 and objective.adv in GROUP_RELATIVE_ADVANTAGES:
            raise ConfigError(
                "rollout.group_size",
                f"must be >= 2 for group-relative advantages (algorithm adv={objective.adv!r}), "
                f"got {r.group_size}",
            )
        if r.group_size < 2 and objective.dynamic_sampling:
            raise ConfigError(
                "rollout.group_size",
                f"must be >= 2 with dynamic_sampling (a group of 1 is always zero-variance), "
                f"got {r.group_size}",
            )
        if w.max_len <= r.max_new_tokens:
            raise ConfigError(
                "workers.max_len",
                f"must exceed rollout.max_new_tokens ({r.max_new_tokens}) to leave room for the "
                f"prompt, got {w.max_len}",
            )
        replicas = self.paramserver.replicas
        if replicas > 1 and self.placement.mode == "colocated":
            raise ConfigError(
                "paramserver.replicas",
                f"a colocated run serves its weights in its one process: replicas must be 1, "
                f"got {replicas} (use placement: disaggregated for replicas)",
            )
        if replicas > 1 and w.count is not None and replicas > w.count:
            raise ConfigError(
                "paramserver.replicas",
                f"{replicas} replicas for {w.count} workers: a replica serves at least one "
                "worker; lower paramserver.replicas or raise workers.count",
            )
        batch = r.prompts_per_step * r.group_size
        mb = self.trainer.micro_batch_size
        if mb is not None and batch % mb:
            raise ConfigError(
                "trainer.micro_batch_size",
                f"must divide the batch of rollout.prompts_per_step × rollout.group_size = "
                f"{batch} sequences, got {mb}",
            )

    # ------------------------------------------------------------------ derived values
    @property
    def run_dir(self) -> str:
        """run_root/<run_id>: where every file of this run lives (local path or gs:// URI)."""
        return storage.join(self.run_root, self.run_id)

    @property
    def max_outstanding_groups(self) -> int:
        """Groups in flight + buffered that the controller allows (see RolloutSettings)."""
        if self.rollout.max_outstanding_groups is not None:
            return self.rollout.max_outstanding_groups
        p, s = self.rollout.prompts_per_step, self.staleness
        if s.reload_every == 1 and s.max_staleness == 1:
            return p
        return p * (s.reload_every + 1)

    @property
    def groups_per_worker(self) -> int:
        if self.workers.groups_per_worker is not None:
            return self.workers.groups_per_worker
        return max(1, self.workers.slots // self.rollout.group_size)

    def objective_overrides(self) -> dict[str, Any]:
        """``algorithm.overrides`` plus what the run pins: Dr. GRPO's constant L_max.

        ``agg="max_length"`` without ``max_length`` would normalise by the padded batch width;
        the run fixes it to ``rollout.max_new_tokens`` (Dr. GRPO's choice) unless the config
        sets it."""
        overrides = dict(self.algorithm.overrides)
        if (
            self.algorithm.objective_config().agg == "max_length"
            and overrides.get("max_length") is None
        ):
            overrides["max_length"] = self.rollout.max_new_tokens
        return overrides

    def objective_config(self) -> ObjectiveConfig:
        """The objective the trainer builds: ``preset_config(preset, **objective_overrides())``."""
        return preset_config(self.algorithm.preset, **self.objective_overrides())

    # ------------------------------------------------------------------ serialization
    def to_dict(self) -> dict[str, Any]:
        """Plain data (YAML/JSON): ``RunConfig.from_dict(cfg.to_dict()) == cfg``."""
        out = plain(self)
        out["trainer"] = self.trainer.to_dict()
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RunConfig:
        """Builds and validates; errors name the dotted field, unknown keys are errors."""
        return build(cls, raw, "", _sections)


_SECTIONS: dict[str, Any] = {
    "model": ModelSettings,
    "algorithm": AlgorithmSettings,
    "staleness": StalenessSettings,
    "rollout": RolloutSettings,
    "workers": WorkerSettings,
    "paramserver": ParamServerSettings,
    "eval": EvalSettings,
}


def _sections(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with each nested section (a mapping) built into its class."""
    for name, section in _SECTIONS.items():
        if name in values:
            values[name] = build(section, values[name], name)
    if "trainer" in values:
        try:
            values["trainer"] = trainer_from(values["trainer"])
        except ConfigError as e:
            raise e.under("trainer") from None
    if "prompt" in values and not isinstance(values["prompt"], PromptSettings):
        if not isinstance(values["prompt"], Mapping):
            raise ConfigError("prompt", f"must be a mapping, got {values['prompt']!r}")
        try:
            values["prompt"] = PromptSettings.from_dict(values["prompt"])
        except PromptSettingsError as e:
            raise ConfigError(f"prompt.{e.field}", e.message) from None
    if "datasets" in values:
        items = values["datasets"]
        if not isinstance(items, list | tuple):
            raise ConfigError("datasets", f"must be a list of datasets, got {items!r}")
        built = []
        for i, item in enumerate(items):
            try:
                built.append(build(DatasetSpec, item, ""))
            except ConfigError as e:
                raise e.under(f"datasets[{i}]") from None
        values["datasets"] = tuple(built)
    return values
