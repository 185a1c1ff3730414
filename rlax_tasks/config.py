"""The run configuration as validated data: one frozen dataclass per section, loaded from YAML.

``load_config("tiny-arith", {"staleness.max_staleness": 2})`` loads a preset shipped in
``rlax_tasks/presets/`` (or a YAML file path) and applies overrides (dotted keys or nested dicts).
Every error is a ``ConfigError`` (a ValueError) whose message starts with the dotted field, e.g.
``staleness.max_staleness: must be >= reload_every (1), got 0``; unknown keys are errors with a
did-you-mean. ``RunConfig.to_yaml()`` is the resolved configuration written to
``run_root/<run_id>/config.yaml`` (``save_resolved``); loading it again gives an equal config.
Saving over an existing one (a resume) refuses changed training settings (``ConfigChangeError``)
unless allowed, and records every change in config_changes.jsonl.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import re
import time
from collections.abc import Mapping
from importlib import resources
from typing import Any

import yaml

from rlax_tasks.algorithms.config import FIELD_NAMES as OBJECTIVE_FIELDS
from rlax_tasks.algorithms.config import PRESETS as OBJECTIVE_PRESETS
from rlax_tasks.algorithms.config import ObjectiveConfig, ObjectiveConfigError, preset_config
from rlax_tasks.data.prompts import PromptSettings, PromptSettingsError
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths
from rlax_tasks.trainer.config import TrainerConfig, TrainerConfigError
from rlax_tasks.utils import validation

PRESET_PACKAGE = "rlax_tasks.presets"
DTYPES = ("float32", "bfloat16")
FILE_VERIFIERS = ("math", "code")
# advantages computed relative to the other completions of the same prompt need G >= 2
GROUP_RELATIVE_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "group_batch_norm")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class ConfigError(ValueError):
    """An invalid run configuration; ``field`` is the dotted path of the offending value."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}" if field else message)

    def under(self, prefix: str) -> ConfigError:
        """The same error with ``prefix`` prepended to its field path."""
        if not prefix:
            return self
        if not self.field:
            return ConfigError(prefix, self.message)
        sep = "" if self.field.startswith("[") else "."
        return ConfigError(f"{prefix}{sep}{self.field}", self.message)


# --------------------------------------------------------------------------- value checks
def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


def _check_int(obj: Any, name: str, low: int | None = None, optional: bool = False) -> None:
    validation.check_int(name, getattr(obj, name), ConfigError, minimum=low, optional=optional)


def _check_float(
    obj: Any, name: str, low: float = -math.inf, high: float = math.inf, open_low: bool = False
) -> None:
    value = getattr(obj, name)
    bounds = {"low": low, "high": high, "open_low": open_low, "from_text": True}
    _set(obj, name, validation.check_number(name, value, ConfigError, **bounds))


def _check_str(obj: Any, name: str, choices: tuple[str, ...] | None = None) -> None:
    validation.check_text(name, getattr(obj, name), ConfigError)
    if choices is not None:
        validation.check_choice(name, getattr(obj, name), choices, ConfigError)


def _check_bool(obj: Any, name: str) -> None:
    validation.check_bool(name, getattr(obj, name), ConfigError)


def _check_mesh_shape(obj: Any, name: str) -> None:
    _set(obj, name, validation.check_mesh_shape(name, getattr(obj, name), ConfigError))


def _field_named(message: str, fields: Any) -> str:
    """The field a validation message starts with (longest match), or ""."""
    best = ""
    for f in fields:
        if message.startswith(f) and len(f) > len(best):
            nxt = message[len(f) : len(f) + 1]
            if not (nxt.isalnum() or nxt == "_"):
                best = f
    return best


def _plain(value: Any) -> Any:
    """Tuples → lists and dataclasses → dicts, for YAML output."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# --------------------------------------------------------------------------- sections
@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The base policy: an HF-format directory (local or gs://) and its precision (DESIGN §12).

    ``dtype`` is the compute dtype and what workers hold (and the parameter server carries);
    ``param_dtype`` is the trainer's master weights and optimizer state.
    """

    path: str
    dtype: str = "float32"
    param_dtype: str = "float32"
    # build the base model with the project's short supervised warm-up when ``path`` is missing
    warmup_if_missing: bool = False

    def __post_init__(self) -> None:
        _check_str(self, "path")
        _check_str(self, "dtype", DTYPES)
        _check_str(self, "param_dtype", DTYPES)
        _check_bool(self, "warmup_if_missing")


@dataclasses.dataclass(frozen=True)
class AlgorithmSettings:
    """An objective preset of DESIGN §4 plus field overrides (validated by ``preset_config``)."""

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
        _set(self, "overrides", dict(self.overrides))
        try:
            self.objective_config()
        except ObjectiveConfigError as e:
            field = _field_named(str(e), OBJECTIVE_FIELDS)
            raise ConfigError(f"overrides.{field}" if field else "overrides", str(e)) from None

    def objective_config(self) -> ObjectiveConfig:
        """The validated objective configuration (what ``make_objective`` would build)."""
        return preset_config(self.preset, **self.overrides)


@dataclasses.dataclass(frozen=True)
class StalenessSettings:
    """DESIGN §3: workers reload when ≥ j versions behind; rollouts train only if v − u ≤ k."""

    reload_every: int = 1
    max_staleness: int | None = 1

    def __post_init__(self) -> None:
        _check_int(self, "reload_every", low=1)
        _check_int(self, "max_staleness", optional=True)
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
    # groups in flight + buffered at most; null = prompts_per_step × (reload_every + 1), or
    # prompts_per_step for lockstep on-policy (j = k = 1)
    max_outstanding_groups: int | None = None

    def __post_init__(self) -> None:
        _check_int(self, "group_size", low=1)
        _check_int(self, "prompts_per_step", low=1)
        _check_int(self, "max_new_tokens", low=1)
        _check_float(self, "temperature", low=0.0)
        _check_float(self, "top_p", low=0.0, high=1.0, open_low=True)
        _check_int(self, "top_k", low=0)
        _check_int(self, "max_outstanding_groups", low=1, optional=True)
        if (
            self.max_outstanding_groups is not None
            and self.max_outstanding_groups < self.prompts_per_step
        ):
            raise ConfigError(
                "max_outstanding_groups",
                f"must be >= prompts_per_step ({self.prompts_per_step}) or a batch can never "
                f"fill, got {self.max_outstanding_groups}",
            )


@dataclasses.dataclass(frozen=True)
class SyntheticSource:
    """A synthetic task of ``rlax_tasks.rewards.tasks`` (make_task(task, **knobs)): the first
    ``size`` problems of its stream for ``seed``. ``prompt_format`` "compact" renders arithmetic
    as "12+34=" (the tiny-arith models' format, rlax_tasks.warmup.TinyArith)."""

    task: str
    knobs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    size: int = 10_000
    seed: int = 0
    prompt_format: str = "task"
    # leave out every problem of another stream's first exclude_size problems (the held-out
    # evaluation set: small tasks repeat problems across streams)
    exclude_seed: int | None = None
    exclude_size: int = 0

    def __post_init__(self) -> None:
        from rlax_tasks.rewards.tasks import TASKS, make_task

        if self.task not in TASKS:
            raise ConfigError(
                "task",
                f"unknown task {self.task!r}{validation.did_you_mean(self.task, TASKS)}; "
                f"valid: {', '.join(sorted(TASKS))}",
            )
        if not isinstance(self.knobs, Mapping):
            raise ConfigError("knobs", f"must be a mapping, got {self.knobs!r}")
        _set(self, "knobs", dict(self.knobs))
        _check_int(self, "size", low=1)
        _check_int(self, "seed")
        _check_str(self, "prompt_format", ("task", "compact"))
        _check_int(self, "exclude_seed", optional=True)
        _check_int(self, "exclude_size", low=0)
        if self.exclude_seed is not None and self.exclude_seed == self.seed:
            raise ConfigError("exclude_seed", f"must differ from seed ({self.seed})")
        if self.prompt_format == "compact" and self.task != "arithmetic":
            raise ConfigError(
                "prompt_format", f"'compact' is for the arithmetic task, not {self.task!r}"
            )
        try:
            make_task(self.task, **copy.deepcopy(dict(self.knobs)))
        except (ValueError, TypeError) as e:
            raise ConfigError("knobs", str(e)) from None


@dataclasses.dataclass(frozen=True)
class FileSource:
    """A dataset file (JSONL/Parquet/CSV, local or gs://) in a layout ``format`` reads
    (DESIGN §11: rlax, gsm8k, math, dapo, messages, code, or columns with ``columns``);
    ``verifier`` defaults to the format's (code for code, else math)."""

    path: str
    verifier: str | None = None
    format: str = "rlax"
    columns: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        _check_str(self, "path")
        from rlax_tasks.data.files import file_format
        from rlax_tasks.data.formats import FORMAT_NAMES, get_format

        if not self.path.endswith("/"):
            try:
                file_format(self.path)
            except ValueError as e:
                raise ConfigError("path", str(e)) from None
        _check_str(self, "format", FORMAT_NAMES)
        if self.columns is not None and not isinstance(self.columns, Mapping):
            raise ConfigError(
                "columns", f"must be a mapping of fields to columns, got {self.columns!r}"
            )
        try:
            fmt = get_format(self.format, self.columns)
        except ValueError as e:
            raise ConfigError("columns", str(e).removeprefix("columns: ")) from None
        if self.columns is not None:
            _set(self, "columns", dict(self.columns))
        if self.verifier is None:
            _set(self, "verifier", fmt.verifier)
        _check_str(self, "verifier", FILE_VERIFIERS)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """One component of the prompt mixture; ``name`` becomes the prefix of its prompt ids."""

    name: str
    source: SyntheticSource | FileSource
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ConfigError(
                "name",
                f"must be letters, digits, '_', '.', '-' (it prefixes prompt ids), "
                f"got {self.name!r}",
            )
        if isinstance(self.source, Mapping):
            _set(self, "source", _source_from(self.source))
        if not isinstance(self.source, SyntheticSource | FileSource):
            raise ConfigError("source", f"must be a synthetic task or a file, got {self.source!r}")
        _check_float(self, "weight", low=0.0, open_low=True)

    @property
    def verifier(self) -> str:
        """How responses are scored: "task" (the synthetic task's scorer), "math" or "code"."""
        return "task" if isinstance(self.source, SyntheticSource) else self.source.verifier


def _source_from(raw: Mapping[str, Any]) -> SyntheticSource | FileSource:
    if "task" in raw and "path" in raw:
        raise ConfigError("", "give either task (synthetic) or path (a file), not both").under(
            "source"
        )
    if "task" in raw:
        return _build(SyntheticSource, raw, "source")
    if "path" in raw:
        return _build(FileSource, raw, "source")
    raise ConfigError(
        "source",
        "needs task: <arithmetic|countdown> (synthetic) or path: <file.parquet|.jsonl> "
        "(with format: gsm8k, math, dapo, messages, code, columns or rlax)",
    )


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

    def __post_init__(self) -> None:
        _check_mesh_shape(self, "mesh_shape")
        _check_int(self, "count", low=1, optional=True)
        _check_int(self, "slots", low=1)
        _check_int(self, "max_len", low=2)
        _check_int(self, "groups_per_worker", low=1, optional=True)
        _check_float(self, "timeout_s", low=0.0, open_low=True)


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
            _set(self, "dataset", _build(DatasetSpec, self.dataset, "dataset"))
        if self.dataset is not None and not isinstance(self.dataset, DatasetSpec):
            raise ConfigError("dataset", f"must be a dataset spec or null, got {self.dataset!r}")
        _check_int(self, "num_prompts", low=1)
        _check_int(self, "num_samples", low=1)
        if not isinstance(self.ks, list | tuple) or not self.ks:
            raise ConfigError("ks", f"must be a non-empty list of integers, got {self.ks!r}")
        _set(self, "ks", tuple(self.ks))
        for k in self.ks:
            if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.num_samples:
                raise ConfigError(
                    "ks",
                    f"each k must be an integer in [1, num_samples={self.num_samples}], got {k!r}",
                )
        _check_float(self, "temperature", low=0.0)
        _check_int(self, "every_steps", low=0)


def _device_list(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(name, f"must be a non-empty list of device indices, got {value!r}")
    for d in value:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise ConfigError(name, f"device indices are integers >= 0, got {d!r}")
        if list(value).count(d) > 1:
            raise ConfigError(name, f"device {d} is listed twice")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class PlacementSettings:
    """Where the jobs run and on which devices (DESIGN §12); rlax_tasks/run/placement.py turns
    it into each job's environment. ``placement: disaggregated`` is short for {mode: ...}.

    ``trainer`` and each list of ``workers`` are device indices on a host (GPUs, TPU chips; on
    cpu n indices force n host devices); null = every device the host shows (cpu, auto). With
    ``hosts`` H > 1 the trainer spans H hosts (one jax.distributed job over H × len(trainer)
    devices) and every host also runs one worker per list (workers.count = H × len(workers));
    the parameter server and controller run once, on CPU.
    """

    # disaggregated: PS, trainer, workers and controller as separate jobs (slices, async j/k);
    # colocated: all of them in one process on the trainer's devices, the sampler reading the
    # trainer's weights in memory (rlax_tasks/run/colocated.py): one host, workers.count 1.
    # null: colocated on a single-accelerator host, else disaggregated (``default_mode``)
    mode: str | None = None
    # gpu | tpu | cpu | auto (nothing forced: JAX picks what the host has)
    platform: str = "auto"
    # for the memory plan (rlax run --dry-run): h100-80gb, h200, a100-40gb, a100-80gb, v4, v5e,
    # v5p, v6e; null = the fit is not checked (cpu: host RAM)
    accelerator: str | None = None
    hosts: int = 1
    trainer: tuple[int, ...] | None = None
    workers: tuple[tuple[int, ...], ...] | None = None
    # gpu: XLA_PYTHON_CLIENT_MEM_FRACTION of every process; null = 0.9 split between the
    # processes that share a GPU
    memory_fraction: float | None = None
    # RAM of a host (bytes or "2TiB"); null = this machine's. The parameter server keeps
    # versions in 25% of it (rlax_tasks/run/plan.py)
    host_memory: int | None = None

    def __post_init__(self) -> None:
        from rlax_tasks.compute.devices import (
            ACCELERATORS,
            MODES,
            PLATFORMS,
            TPU_CHIP_BOUNDS,
        )
        from rlax_tasks.utils.byte_sizes import parse_bytes

        if self.mode is not None:
            _check_str(self, "mode", MODES)
        _check_str(self, "platform", PLATFORMS)
        _check_int(self, "hosts", low=1)
        if self.accelerator is not None:
            _check_str(self, "accelerator", tuple(ACCELERATORS))
            kind = ACCELERATORS[self.accelerator].platform
            if kind != self.platform:
                raise ConfigError(
                    "accelerator",
                    f"{self.accelerator!r} is a {kind} accelerator; set platform: {kind} "
                    f"(platform is {self.platform!r})",
                )
        if self.trainer is not None:
            _set(self, "trainer", _device_list(self.trainer, "trainer"))
        if self.workers is not None:
            if not isinstance(self.workers, list | tuple) or not self.workers:
                raise ConfigError(
                    "workers",
                    f"must be a list of device lists, one per worker, got {self.workers!r}",
                )
            _set(
                self,
                "workers",
                tuple(_device_list(w, f"workers[{i}]") for i, w in enumerate(self.workers)),
            )
        if self.memory_fraction is not None:
            _check_float(self, "memory_fraction", low=0.0, high=1.0, open_low=True)
            if self.platform != "gpu":
                raise ConfigError("memory_fraction", "applies to platform gpu only")
        if self.host_memory is not None:
            try:
                _set(self, "host_memory", parse_bytes(self.host_memory))
            except ValueError as e:
                raise ConfigError("host_memory", str(e)) from None
            if self.host_memory <= 0:
                raise ConfigError("host_memory", "must be positive")
        if self.mode == "colocated":
            self._check_colocated()
        self._check_devices(TPU_CHIP_BOUNDS)

    def default_mode(self, workers_count: int | None, trainer_hosts: int = 1) -> str:
        """The mode of a placement that names none: colocated on a single-accelerator host (gpu
        or tpu, one host, one trainer device, no worker device lists, at most one worker: a
        second process on the one device would only split its memory), else disaggregated."""
        single = (
            self.platform in ("gpu", "tpu")
            and self.hosts == 1
            and trainer_hosts == 1
            and self.trainer is not None
            and len(self.trainer) == 1
            and self.workers is None
            and workers_count in (None, 1)
        )
        return "colocated" if single else "disaggregated"

    def _check_colocated(self) -> None:
        """Colocated: one process on one host's devices (the trainer's, shared by the sampler)."""
        if self.hosts > 1:
            raise ConfigError(
                "hosts",
                "a colocated run is one process on one host; use mode: disaggregated for "
                "several hosts",
            )
        if self.workers is not None:
            raise ConfigError(
                "workers",
                "a colocated sampler runs on the trainer's devices (placement.trainer); leave "
                "placement.workers out, or use mode: disaggregated",
            )

    def _check_devices(self, tpu_bounds: Mapping[int, str]) -> None:
        lists = {"trainer": self.trainer}
        lists.update({f"workers[{i}]": w for i, w in enumerate(self.workers or ())})
        if self.platform == "auto":
            for name, devices in lists.items():
                if devices is not None:
                    raise ConfigError(
                        name.split("[")[0],
                        "device lists need platform gpu, tpu or cpu (auto forces nothing)",
                    )
            return
        # the workers' lists a disaggregated run needs are RunConfig's check: whether colocated
        # is the way out depends on trainer.hosts and workers.count
        if self.platform in ("gpu", "tpu") and self.trainer is None:
            raise ConfigError(
                "trainer",
                f"give the trainer's device indices on the host for platform {self.platform}, "
                "e.g. [0, 1, 2, 3]",
            )
        if self.platform != "tpu":
            if self.memory_fraction is not None:
                for d in {d for devices in lists.values() for d in devices or ()}:
                    n = sum(d in (devices or ()) for devices in lists.values())
                    if n * self.memory_fraction > 1.0:
                        raise ConfigError(
                            "memory_fraction",
                            f"{n} processes share GPU {d}: {n} × {self.memory_fraction} is more "
                            f"than the whole device",
                        )
            return
        if self.hosts > 1:
            raise ConfigError(
                "hosts",
                "a multi-host TPU slice cannot be split between jobs (libtpu gives each process "
                "every chip of its hosts); run the trainer and the workers on slices of their own",
            )
        owner: dict[int, str] = {}
        for name, devices in lists.items():
            n = len(devices or ())
            ids = sorted(devices or ())
            if n not in tpu_bounds or ids != list(range(ids[0], ids[0] + n)) or ids[0] % n:
                raise ConfigError(
                    name,
                    f"a TPU process takes 1, 2, 4 or 8 chips forming a block of the host "
                    f"(e.g. [0, 1], [2, 3], [4, 5, 6, 7]), got {list(devices or ())}",
                )
            for d in ids:
                if d in owner:
                    raise ConfigError(
                        name,
                        f"TPU chip {d} is also {owner[d]}'s: TPU chips cannot be shared between "
                        f"processes",
                    )
                owner[d] = "the trainer" if name == "trainer" else f"placement.{name}"


def _trainer_from(raw: Any) -> TrainerConfig:
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
        field = _field_named(str(e), known)
        rest = str(e)[len(field) :]
        raise ConfigError(field, rest.strip() if rest.startswith(" must") else str(e)) from None


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
    eval: EvalSettings = EvalSettings()
    # how every prompt is rendered: training, held-out evaluation, rlax eval, the DAGs (§11)
    prompt: PromptSettings = PromptSettings()
    # JAX's persistent compilation cache under run_root/jax-cache: a restarted component (or a
    # later run of the same shapes) loads its compiled programs instead of compiling again
    compilation_cache: bool = True
    # which devices each job gets (DESIGN §12); `placement: disaggregated` is the short form
    placement: PlacementSettings = PlacementSettings()

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not _NAME_RE.match(self.run_id):
            raise ConfigError(
                "run_id", f"must be letters, digits, '_', '.', '-', got {self.run_id!r}"
            )
        _check_str(self, "run_root")
        _check_int(self, "seed")
        if not isinstance(self.compilation_cache, bool):
            raise ConfigError(
                "compilation_cache", f"must be true or false, got {self.compilation_cache!r}"
            )
        if not isinstance(self.datasets, list | tuple) or not self.datasets:
            raise ConfigError("datasets", "give at least one dataset")
        _set(self, "datasets", tuple(self.datasets))
        names = [d.name for d in self.datasets]
        for i, name in enumerate(names):
            if name in names[:i]:
                raise ConfigError(
                    f"datasets[{i}].name", f"duplicate dataset name {name!r}: names must be unique"
                )
        raw = self.placement
        if raw is None or isinstance(raw, str | Mapping):
            raw = {} if raw is None else {"mode": raw} if isinstance(raw, str) else raw
            _set(self, "placement", _build(PlacementSettings, raw, "placement"))
        if not isinstance(self.placement, PlacementSettings):
            raise ConfigError(
                "placement", f"must be a mapping or a mode name, got {self.placement!r}"
            )
        self._resolve_defaults()
        self._cross_checks()
        self._placement_checks()

    def _resolve_defaults(self) -> None:
        """Names what the configuration left to the host's shape: the placement's mode
        (``PlacementSettings.default_mode``) and workers.count (1 colocated, else one per
        device list of placement.workers, else 2); the saved config.yaml records both. A
        disaggregated run on gpu or tpu must name its workers' devices: the check is here, where
        trainer.hosts and workers.count say whether colocated is the way out."""
        p = self.placement
        if p.mode is None:
            try:
                mode = p.default_mode(self.workers.count, self.trainer.hosts)
                p = dataclasses.replace(p, mode=mode)
            except ConfigError as e:
                raise e.under("placement") from None
            _set(self, "placement", p)
        if p.mode == "disaggregated" and p.platform in ("gpu", "tpu") and p.workers is None:
            raise ConfigError("placement.workers", self._missing_worker_devices())
        if self.workers.count is None:
            if p.mode == "colocated":
                count = 1
            elif p.workers is not None:  # one worker per device list (of each host)
                count = p.hosts * len(p.workers)
            else:
                count = 2
            _set(self, "workers", dataclasses.replace(self.workers, count=count))

    def _placement_checks(self) -> None:
        """The placement against the workers and meshes it must carry."""
        from rlax_tasks.compute.devices import resolve_mesh

        p = self.placement
        if p.mode == "colocated":
            if self.trainer.hosts > 1:
                raise ConfigError(
                    "trainer.hosts",
                    f"is {self.trainer.hosts}, but a colocated run is one process on one host: "
                    "use placement.mode: disaggregated for a multi-host trainer",
                )
            if self.workers.count != 1:
                raise ConfigError(
                    "workers.count",
                    f"is {self.workers.count}, but a colocated run has one sampler beside the "
                    "trainer: set workers.count: 1 (and workers.slots to the concurrency you "
                    "want), or use placement.mode: disaggregated",
                )
        if p.hosts > 1:  # GPU nodes that each carry a share of the trainer and their workers
            if self.trainer.hosts == 1:
                _set(self, "trainer", dataclasses.replace(self.trainer, hosts=p.hosts))
            elif self.trainer.hosts != p.hosts:
                raise ConfigError(
                    "trainer.hosts",
                    f"is {self.trainer.hosts} but placement.hosts is {p.hosts}: the trainer spans "
                    "every host of the placement (leave trainer.hosts out, or make them equal)",
                )
        if p.workers is not None and p.hosts * len(p.workers) != self.workers.count:
            per_host = f"{p.hosts} hosts × {len(p.workers)}" if p.hosts > 1 else len(p.workers)
            raise ConfigError(
                "placement.workers",
                f"lists {per_host} worker(s) but workers.count is {self.workers.count}: give "
                f"one device list per worker{' of a host' if p.hosts > 1 else ''}",
            )
        if p.trainer is not None:
            n = self.trainer.hosts * len(p.trainer)
            try:
                resolve_mesh(self.trainer.mesh_shape, n)
            except ValueError as e:
                raise ConfigError(
                    "trainer.mesh_shape",
                    f"{e}: the trainer has {n} device(s) (placement.trainer"
                    f"{' × trainer.hosts' if self.trainer.hosts > 1 else ''})",
                ) from None
        for i, devices in enumerate(p.workers or ()):
            try:
                resolve_mesh(self.workers.mesh_shape, len(devices))
            except ValueError as e:
                raise ConfigError(
                    "workers.mesh_shape",
                    f"{e}: worker list placement.workers[{i}] has {len(devices)} device(s)",
                ) from None

    def _missing_worker_devices(self) -> str:
        """What a disaggregated run on gpu or tpu without placement.workers should give, and
        colocated as the other way where this run could be one (one host, one sampler)."""
        p = self.placement
        message = (
            f"give each worker's device indices on the host for platform {p.platform}, "
            "e.g. [[4, 5], [6, 7]]"
        )
        if p.hosts > 1 or self.trainer.hosts > 1:
            return message + " (a trainer on several hosts runs disaggregated)"
        count = "" if self.workers.count in (None, 1) else "workers.count: 1 and "
        return (
            f"{message} (or {count}mode: colocated: one process, the sampler on the trainer's "
            "devices)"
        )

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

        ``agg="max_length"`` without ``max_length`` would normalise by the width of each batch's
        token arrays, which changes with padding; the run fixes it to the generation budget
        ``rollout.max_new_tokens`` (Dr. GRPO's choice) unless the config sets it.
        """
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
        out = _plain(self)
        out["trainer"] = self.trainer.to_dict()
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> RunConfig:
        """Builds and validates; errors name the dotted field, unknown keys are errors."""
        return _build(cls, raw, "")


_SECTIONS: dict[str, Any] = {
    "model": ModelSettings,
    "algorithm": AlgorithmSettings,
    "staleness": StalenessSettings,
    "rollout": RolloutSettings,
    "workers": WorkerSettings,
    "eval": EvalSettings,
}


def _build(cls: type, raw: Any, path: str) -> Any:
    """``cls(**raw)`` with unknown/missing keys and nested sections checked; errors prefixed."""
    if not isinstance(raw, Mapping):
        raise ConfigError(path, f"must be a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    try:
        validation.check_known(raw, fields, ConfigError)
    except ConfigError as e:
        raise e.under(path) from None
    missing = [
        n
        for n, f in fields.items()
        if n not in raw
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING  # type: ignore[misc]
    ]
    if missing:
        raise ConfigError(missing[0], "is required").under(path)
    values = dict(raw)
    try:
        if cls is RunConfig:
            for name, section in _SECTIONS.items():
                if name in values:
                    values[name] = _build(section, values[name], name)
            if "trainer" in values:
                try:
                    values["trainer"] = _trainer_from(values["trainer"])
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
                        built.append(_build(DatasetSpec, item, ""))
                    except ConfigError as e:
                        raise e.under(f"datasets[{i}]") from None
                values["datasets"] = tuple(built)
        return cls(**values)
    except ConfigError as e:
        raise e.under(path) from None


# --------------------------------------------------------------------------- loading
def preset_names() -> list[str]:
    """Names of the presets shipped in rlax_tasks/presets/ (file stems)."""
    root = resources.files(PRESET_PACKAGE)
    return sorted(p.name[: -len(".yaml")] for p in root.iterdir() if p.name.endswith(".yaml"))


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
    "model.warmup_if_missing": False,
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
        before = _flat(_plain(old))
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

    When the run already has a config.yaml (a resume), settings that change training (see
    ``_CHANGES_TRAINING``) must be unchanged, else ``ConfigChangeError`` (nothing written) unless
    ``allow_config_change``; every accepted change is appended to config_changes.jsonl with the
    step it applies after (the run's last trained step).
    """
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
