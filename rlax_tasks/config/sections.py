"""The run configuration's sections: model, objective, staleness, rollout, workers, evaluation.

One frozen dataclass per section, each validated in ``__post_init__`` (errors name the field);
``trainer_from`` reads the trainer section into the trainer's own ``TrainerConfig``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rlax_tasks.algorithms.config import FIELD_NAMES as OBJECTIVE_FIELDS
from rlax_tasks.algorithms.config import PRESETS as OBJECTIVE_PRESETS
from rlax_tasks.algorithms.config import ObjectiveConfig, ObjectiveConfigError, preset_config
from rlax_tasks.config.checks import (
    ConfigError,
    build,
    check_bool,
    check_float,
    check_int,
    check_mesh_shape,
    check_str,
    field_named,
    set_field,
)
from rlax_tasks.config.datasets import DatasetSpec
from rlax_tasks.models.packaged import PACKAGED_MODELS
from rlax_tasks.trainer.config import TrainerConfig, TrainerConfigError
from rlax_tasks.utils import validation

DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The base policy: an HF-format directory (local or gs://) and its precision (docs/design.md
    §12).

    ``dtype`` is the compute dtype and what workers hold (and the parameter server carries);
    ``param_dtype`` is the trainer's master weights and optimizer state.
    """

    path: str
    dtype: str = "float32"
    param_dtype: str = "float32"
    # build the base model with the project's short supervised warm-up when ``path`` is missing
    warmup_if_missing: bool = False
    # or import this packaged model (rlax_tasks.models.packaged) into ``path`` when missing
    import_if_missing: str | None = None

    def __post_init__(self) -> None:
        check_str(self, "path")
        check_str(self, "dtype", DTYPES)
        check_str(self, "param_dtype", DTYPES)
        check_bool(self, "warmup_if_missing")
        if self.import_if_missing is not None:
            check_str(self, "import_if_missing", tuple(sorted(PACKAGED_MODELS)))
        if self.warmup_if_missing and self.import_if_missing:
            raise ConfigError(
                "import_if_missing", "choose one way to build a missing model: not both"
            )


@dataclasses.dataclass(frozen=True)
class AlgorithmSettings:
    """An objective preset of docs/design.md §4 plus field overrides (validated by
    ``preset_config``)."""

    preset: str = "grpo"
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.preset, str) or self.preset not in OBJECTIVE_PRESETS:
            raise ConfigError(
                "preset",
                f"unknown objective preset {self.preset!r}"
                f"{validation.did_you_mean(self.preset, OBJECTIVE_PRESETS)}; "
                f"valid: {', '.join(OBJECTIVE_PRESETS)}",
            )
        if not isinstance(self.overrides, Mapping):
            raise ConfigError(
                "overrides", f"must be a mapping of objective fields, got {self.overrides!r}"
            )
        validation.check_known(
            self.overrides,
            OBJECTIVE_FIELDS,
            lambda key, detail: ConfigError(f"overrides.{key}", detail),
            "objective field",
        )
        set_field(self, "overrides", dict(self.overrides))
        try:
            self.objective_config()
        except ObjectiveConfigError as e:
            field = field_named(str(e), OBJECTIVE_FIELDS)
            raise ConfigError(f"overrides.{field}" if field else "overrides", str(e)) from None

    def objective_config(self) -> ObjectiveConfig:
        """The validated objective configuration (what ``make_objective`` would build)."""
        return preset_config(self.preset, **self.overrides)


@dataclasses.dataclass(frozen=True)
class StalenessSettings:
    """docs/design.md §3: workers reload when ≥ j versions behind; rollouts train only if
    v − u ≤ k."""

    reload_every: int = 1
    max_staleness: int | None = 1

    def __post_init__(self) -> None:
        check_int(self, "reload_every", low=1)
        check_int(self, "max_staleness", optional=True)
        k, j = self.max_staleness, self.reload_every
        if k is not None and k < j:
            raise ConfigError(
                "max_staleness",
                f"must be >= reload_every ({j}), got {k}: rollouts of a worker that reloads "
                f"every {j} version(s) are up to {j} version(s) old when they train, and k < j "
                f"would drop them (null = unbounded)",
            )


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """G completions per prompt, sampling settings, prompts (groups) per training step."""

    group_size: int = 8
    prompts_per_step: int = 16
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # sampling-mask replay: with top_k or top_p on, the workers record up to this many ids
    # their filter kept per token and the trainer takes its log-probs over them; a token whose
    # nucleus holds more keeps the whole vocabulary (the support_replayed_frac metric); 0 = off
    support_capacity: int = 64
    # groups in flight + buffered at most; null = prompts_per_step × (reload_every + 1), or
    # prompts_per_step for lockstep on-policy (j = k = 1)
    max_outstanding_groups: int | None = None

    def __post_init__(self) -> None:
        check_int(self, "group_size", low=1)
        check_int(self, "prompts_per_step", low=1)
        check_int(self, "max_new_tokens", low=1)
        check_float(self, "temperature", low=0.0)
        check_float(self, "top_p", low=0.0, high=1.0, open_low=True)
        check_int(self, "top_k", low=0)
        check_int(self, "support_capacity", low=0)
        if 0 < self.support_capacity < self.top_k:
            raise ConfigError(
                "support_capacity",
                f"must be >= top_k ({self.top_k}) to record each token's kept ids (or 0 to "
                f"replay none), got {self.support_capacity}",
            )
        check_int(self, "max_outstanding_groups", low=1, optional=True)
        if (
            self.max_outstanding_groups is not None
            and self.max_outstanding_groups < self.prompts_per_step
        ):
            raise ConfigError(
                "max_outstanding_groups",
                f"must be >= prompts_per_step ({self.prompts_per_step}) or a batch can never "
                f"fill, got {self.max_outstanding_groups}",
            )

    @property
    def logprob_temperature(self) -> float:
        """The temperature of the distribution the rollouts' tokens were drawn from, at which the
        trainer takes its log-probs: ``temperature``, or 1 for greedy (0) sampling."""
        return self.temperature if self.temperature > 0 else 1.0

    @property
    def support_size(self) -> int:
        """Kept ids a worker records per token (its sampler's ``support_capacity``): none unless
        top-k or top-p filters the sampled distribution, at most top_k with top-k."""
        filters = self.temperature > 0 and (self.top_k > 0 or self.top_p < 1.0)
        if not filters:
            return 0
        return min(self.support_capacity, self.top_k) if self.top_k else self.support_capacity


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """The inference fleet: how many workers, sampler slots and sequence length per worker."""

    # null: 1 in a colocated run (its one sampler), else one per device list of
    # placement.workers (on each host), else 2
    count: int | None = None
    slots: int = 32
    max_len: int = 512
    # groups the controller keeps in flight per worker; null = max(1, slots // group_size)
    groups_per_worker: int | None = None
    # a worker with work in flight and no result for this long is treated as dead
    timeout_s: float = 300.0
    # each worker's mesh over its own devices (data, fsdp, tensor); one entry may be -1 for
    # "the remaining devices": [1, 1, -1] = tensor parallel over every device the worker sees
    mesh_shape: tuple[int, int, int] = (1, 1, -1)
    # a worker pulling over TCP (on another host than the PS) keeps a host copy of its version
    # to receive the next as the changed elements only (docs/design.md §6); false: whole versions
    delta_pulls: bool = True
    # at a reload, the sequences in flight keep their tokens and continue on the new weights
    # (each token records its version); false: they are dropped and generated again
    interrupt_on_reload: bool = True
    # decode reads each layer's weights as arrays of their own, a second copy of the layers in
    # device memory (the memory plan's decode_layers); false: it reads them through a copy of the
    # stacked layers' slice at every step (about 3x the weights' traffic of a memory-bound step)
    decode_layer_copies: bool = True

    def __post_init__(self) -> None:
        check_mesh_shape(self, "mesh_shape")
        check_bool(self, "delta_pulls")
        check_bool(self, "interrupt_on_reload")
        check_bool(self, "decode_layer_copies")
        check_int(self, "count", low=1, optional=True)
        check_int(self, "slots", low=1)
        check_int(self, "max_len", low=2)
        check_int(self, "groups_per_worker", low=1, optional=True)
        check_float(self, "timeout_s", low=0.0, open_low=True)


RELAYS = ("star", "chain")


@dataclasses.dataclass(frozen=True)
class ParamServerSettings:
    """Parameter-server replicas (docs/design.md §16): the trainer pushes to replica 0, the
    others relay each version from it (``star``) or each from the one before (``chain``), and
    the workers are spread evenly over all of them, failing over when theirs is gone."""

    replicas: int = 1
    relay: str = "star"

    def __post_init__(self) -> None:
        check_int(self, "replicas", low=1)
        check_str(self, "relay", RELAYS)


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """Held-out evaluation: pass@k over ``num_prompts`` prompts with ``num_samples`` each."""

    dataset: DatasetSpec | None = None
    num_prompts: int = 200
    num_samples: int = 8
    ks: tuple[int, ...] = (1, 8)
    temperature: float = 1.0
    # evaluate every N training steps besides before and after the run (0 = only those two)
    every_steps: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.dataset, Mapping):
            set_field(self, "dataset", build(DatasetSpec, self.dataset, "dataset"))
        if self.dataset is not None and not isinstance(self.dataset, DatasetSpec):
            raise ConfigError("dataset", f"must be a dataset spec or null, got {self.dataset!r}")
        check_int(self, "num_prompts", low=1)
        check_int(self, "num_samples", low=1)
        if not isinstance(self.ks, list | tuple) or not self.ks:
            raise ConfigError("ks", f"must be a non-empty list of integers, got {self.ks!r}")
        set_field(self, "ks", tuple(self.ks))
        for k in self.ks:
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.num_samples:
                raise ConfigError(
                    "ks",
                    f"each k must be an integer in [1, num_samples={self.num_samples}], got {k!r}",
                )
        check_float(self, "temperature", low=0.0)
        check_int(self, "every_steps", low=0)


def trainer_from(raw: Any) -> TrainerConfig:
    """The trainer section as a ``TrainerConfig``; its errors name the field."""
    if isinstance(raw, TrainerConfig):
        return raw
    if not isinstance(raw, Mapping):
        raise ConfigError("", f"must be a mapping of trainer settings, got {raw!r}")
    known = [f.name for f in dataclasses.fields(TrainerConfig)]
    validation.check_known(raw, known, ConfigError)
    values = dict(raw)
    for name in ("learning_rate", "adam_eps", "weight_decay", "max_grad_norm"):
        if isinstance(values.get(name), str):  # YAML 1.1 reads 1e-4 as text
            values[name] = validation.check_number(name, values[name], ConfigError, from_text=True)
    try:
        return TrainerConfig.from_dict(values)
    except TrainerConfigError as e:
        field = field_named(str(e), known)
        rest = str(e)[len(field) :]
        raise ConfigError(field, rest.strip() if rest.startswith(" must") else str(e)) from None
