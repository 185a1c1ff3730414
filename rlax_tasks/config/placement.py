"""Placement: where a run's jobs go and on which devices, and the hardware rules (docs/design.md
§12).

``PlacementSettings`` checks a placement on its own (platforms, accelerators, device lists, TPU
chip blocks, GPU memory shares); ``resolve_placement`` and ``check_run_placement`` fill in and
check what depends on the rest of the run (mode, workers.count, trainer hosts, meshes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rlax_tasks.compute.devices import (
    ACCELERATORS,
    MODES,
    PLATFORMS,
    TPU_CHIP_BOUNDS,
    resolve_mesh,
)
from rlax_tasks.config.checks import (
    ConfigError,
    build,
    check_bool,
    check_float,
    check_int,
    check_str,
    set_field,
)
from rlax_tasks.utils.byte_sizes import parse_bytes

if TYPE_CHECKING:  # for hints only: schema.py imports this module
    from rlax_tasks.config.schema import RunConfig


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
    """Where the jobs run and on which devices (docs/design.md §12); plan/placement.py sets each
    job's env.

    ``trainer``, each ``workers`` list: device indices on a host (on cpu n indices force n host
    devices; null: all it shows). With ``hosts`` H > 1 the trainer is one jax.distributed job over
    H hosts, each running one worker per list; the PS and controller run once, on CPU."""

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
    # the workers run on hosts of their own (rlax_train's worker slices: its plan sets this),
    # each on every device of its host: placement.workers stays null and no chip or GPU of the
    # trainer's host is theirs
    separate_worker_hosts: bool = False
    # the held-out evaluation job's device indices on host 0 (gpu, tpu, cpu): it then evaluates
    # during training too (eval.every_steps); null = the trainer's devices, before and after
    # training only on gpu and tpu
    evaluator: tuple[int, ...] | None = None
    # gpu: XLA_PYTHON_CLIENT_MEM_FRACTION of every process; null = 0.9 split between the
    # processes that share a GPU
    memory_fraction: float | None = None
    # RAM of a host (bytes or "2TiB"); null = this machine's. The parameter server keeps
    # versions in ps_memory_fraction of it (rlax_tasks/plan/memory_plan.py)
    host_memory: int | None = None
    # the share of its host's RAM the parameter server keeps versions in (the rest: the jobs
    # beside it, a worker's delta copy, the page cache)
    ps_memory_fraction: float = 0.25  # memory_plan.PS_RAM_FRACTION

    def __post_init__(self) -> None:
        if self.mode is not None:
            check_str(self, "mode", MODES)
        check_str(self, "platform", PLATFORMS)
        check_int(self, "hosts", low=1)
        check_bool(self, "separate_worker_hosts")
        if self.accelerator is not None:
            check_str(self, "accelerator", tuple(ACCELERATORS))
            kind = ACCELERATORS[self.accelerator].platform
            if kind != self.platform:
                raise ConfigError(
                    "accelerator",
                    f"{self.accelerator!r} is a {kind} accelerator; set platform: {kind} "
                    f"(platform is {self.platform!r})",
                )
        if self.trainer is not None:
            set_field(self, "trainer", _device_list(self.trainer, "trainer"))
        if self.workers is not None:
            if not isinstance(self.workers, list | tuple) or not self.workers:
                raise ConfigError(
                    "workers",
                    f"must be a list of device lists, one per worker, got {self.workers!r}",
                )
            set_field(
                self,
                "workers",
                tuple(_device_list(w, f"workers[{i}]") for i, w in enumerate(self.workers)),
            )
            if self.separate_worker_hosts:
                raise ConfigError(
                    "workers",
                    "the workers run on hosts of their own (separate_worker_hosts: the worker "
                    "slices), each on every device of its host: leave placement.workers out",
                )
        if self.evaluator is not None:
            set_field(self, "evaluator", _device_list(self.evaluator, "evaluator"))
        if self.memory_fraction is not None:
            check_float(self, "memory_fraction", low=0.0, high=1.0, open_low=True)
            if self.platform != "gpu":
                raise ConfigError("memory_fraction", "applies to platform gpu only")
        check_float(self, "ps_memory_fraction", low=0.0, high=0.9, open_low=True)
        if self.host_memory is not None:
            try:
                set_field(self, "host_memory", parse_bytes(self.host_memory, minimum=1))
            except ValueError as e:
                raise ConfigError("host_memory", str(e)) from None
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
            and not self.separate_worker_hosts
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
        if self.separate_worker_hosts:
            raise ConfigError(
                "mode",
                "a colocated run samples on the trainer's devices, but its workers have hosts of "
                "their own (separate_worker_hosts: worker slices): use mode: disaggregated",
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
        if self.evaluator is not None:
            lists["evaluator"] = self.evaluator
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


def placement_from(raw: Any) -> PlacementSettings:
    """The run's ``placement``: a mapping, a mode name (the short form) or null (the defaults)."""
    if raw is None or isinstance(raw, str | Mapping):
        raw = {} if raw is None else {"mode": raw} if isinstance(raw, str) else raw
        return build(PlacementSettings, raw, "placement")
    if not isinstance(raw, PlacementSettings):
        raise ConfigError("placement", f"must be a mapping or a mode name, got {raw!r}")
    return raw


def resolve_placement(run: RunConfig) -> None:
    """Names what the configuration left to the host's shape: the placement's mode
    (``PlacementSettings.default_mode``) and workers.count (1 colocated, else one per
    device list of placement.workers, else 2); the saved config.yaml records both. A
    disaggregated run on gpu or tpu must name its workers' devices: the check is here, where
    trainer.hosts and workers.count say whether colocated is the way out."""
    p = run.placement
    if p.mode is None:
        try:
            mode = p.default_mode(run.workers.count, run.trainer.hosts)
            p = dataclasses.replace(p, mode=mode)
        except ConfigError as e:
            raise e.under("placement") from None
        set_field(run, "placement", p)
    # workers on hosts of their own (worker slices; a trainer over several TPU hosts leaves
    # them no chip) take every device of their host: placement.workers null
    own_hosts = p.separate_worker_hosts or (p.platform == "tpu" and run.trainer.hosts > 1)
    if p.mode == "disaggregated" and p.platform in ("gpu", "tpu") and p.workers is None:
        if not own_hosts:
            raise ConfigError("placement.workers", _missing_worker_devices(run))
    if run.workers.count is None:
        if p.mode == "colocated":
            count = 1
        elif p.workers is not None:  # one worker per device list (of each host)
            count = p.hosts * len(p.workers)
        else:
            count = 2
        set_field(run, "workers", dataclasses.replace(run.workers, count=count))


def check_run_placement(run: RunConfig) -> None:
    """The placement against the workers and meshes it must carry."""
    p = run.placement
    if p.mode == "colocated":
        if run.trainer.hosts > 1:
            raise ConfigError(
                "trainer.hosts",
                f"is {run.trainer.hosts}, but a colocated run is one process on one host: "
                "use placement.mode: disaggregated for a multi-host trainer",
            )
        if run.workers.count != 1:
            raise ConfigError(
                "workers.count",
                f"is {run.workers.count}, but a colocated run has one sampler beside the "
                "trainer: set workers.count: 1 (and workers.slots to the concurrency you "
                "want), or use placement.mode: disaggregated",
            )
    if p.hosts > 1:  # GPU nodes that each carry a share of the trainer and their workers
        if run.trainer.hosts == 1:
            set_field(run, "trainer", dataclasses.replace(run.trainer, hosts=p.hosts))
        elif run.trainer.hosts != p.hosts:
            raise ConfigError(
                "trainer.hosts",
                f"is {run.trainer.hosts} but placement.hosts is {p.hosts}: the trainer spans "
                "every host of the placement (leave trainer.hosts out, or make them equal)",
            )
    if p.workers is not None and p.hosts * len(p.workers) != run.workers.count:
        per_host = f"{p.hosts} hosts × {len(p.workers)}" if p.hosts > 1 else len(p.workers)
        raise ConfigError(
            "placement.workers",
            f"lists {per_host} worker(s) but workers.count is {run.workers.count}: give "
            f"one device list per worker{' of a host' if p.hosts > 1 else ''}",
        )
    if p.platform == "tpu" and run.trainer.hosts > 1:
        _check_multi_host_tpu(run)
    if p.trainer is not None:
        n = run.trainer.hosts * len(p.trainer)
        try:
            resolve_mesh(run.trainer.mesh_shape, n)
        except ValueError as e:
            raise ConfigError(
                "trainer.mesh_shape",
                f"{e}: the trainer has {n} device(s) (placement.trainer"
                f"{' × trainer.hosts' if run.trainer.hosts > 1 else ''})",
            ) from None
    for i, devices in enumerate(p.workers or ()):
        try:
            resolve_mesh(run.workers.mesh_shape, len(devices))
        except ValueError as e:
            raise ConfigError(
                "workers.mesh_shape",
                f"{e}: worker list placement.workers[{i}] has {len(devices)} device(s)",
            ) from None
    if p.evaluator is not None:
        try:
            resolve_mesh(run.workers.mesh_shape, len(p.evaluator))
        except ValueError as e:
            raise ConfigError(
                "workers.mesh_shape",
                f"{e}: the held-out evaluation samples with it over placement.evaluator's "
                f"{len(p.evaluator)} device(s)",
            ) from None


# the chips of each host of a multi-host Cloud TPU slice (every family: rlax_tasks/compute/
# tpu_types.py)
TPU_MULTI_HOST_CHIPS = (0, 1, 2, 3)


def _check_multi_host_tpu(run: RunConfig) -> None:
    """A trainer over several TPU hosts is one libtpu slice over every chip of its hosts (libtpu
    reads the slice's shape from the TPU VM; a process cannot take part of a multi-host slice):
    it lists all the chips of a host. Its workers run on slices of their own (the DAG's plan
    checks: ``rlax_tasks.plan.slices.evaluation_slice``)."""
    p = run.placement
    if p.trainer != TPU_MULTI_HOST_CHIPS:
        raise ConfigError(
            "placement.trainer",
            f"is {list(p.trainer or ())}, but a trainer over {run.trainer.hosts} TPU hosts is one "
            f"libtpu slice over every chip of its hosts: give all of a host's, "
            f"{list(TPU_MULTI_HOST_CHIPS)} (the workers run on slices of their own)",
        )
    if p.evaluator is not None:
        raise ConfigError(
            "placement.evaluator",
            f"under a trainer over {run.trainer.hosts} TPU hosts the held-out evaluation runs on "
            "the first worker slice (every chip of its host): leave placement.evaluator out",
        )


def _missing_worker_devices(run: RunConfig) -> str:
    """What a disaggregated run on gpu or tpu without placement.workers should give, and
    colocated as the other way where this run could be one (one host, one sampler)."""
    p = run.placement
    message = (
        f"give each worker's device indices on the host for platform {p.platform}, "
        "e.g. [[4, 5], [6, 7]]"
    )
    if p.hosts > 1 or run.trainer.hosts > 1:
        return message + " (a trainer on several hosts runs disaggregated)"
    count = "" if run.workers.count in (None, 1) else "workers.count: 1 and "
    return (
        f"{message} (or {count}mode: colocated: one process, the sampler on the trainer's devices)"
    )
