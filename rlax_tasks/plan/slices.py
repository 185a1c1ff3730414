"""Slice sizing: Cloud TPU slices for a run's Params, and the memory plan of the run on them.

In launch order: ``worker_slice_layout`` (before the config: it sets workers.count),
``check_slice`` (the trainer slice against trainer.hosts), ``run_slices`` (every slice to
provision), ``check_slice_memory`` (the model on those chips). Errors name the Param to change."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from typing import Any

from rlax_tasks.compute.ray_cluster import RayBackendError, slice_shape
from rlax_tasks.compute.tpu_types import UnknownAcceleratorError, slice_hosts, tpu_type
from rlax_tasks.plan.memory_plan import (
    MemoryPlan,
    SliceJob,
    job_advice,
    job_bytes,
    plan_for,
    worker_bytes,
)
from rlax_tasks.plan.model_shapes import resolve_model
from rlax_tasks.plan.placement import ACCELERATORS, is_colocated, job_devices, trainer_job
from rlax_tasks.plan.topology import TRAINER_SLICE, WorkerSlices, worker_slice
from rlax_tasks.utils.byte_sizes import format_bytes

log = logging.getLogger(__name__)
# TPU VM runtime versions (images), e.g. "v2-alpha-tpuv5-lite", "tpu-ubuntu2204-base"
RUNTIME_VERSION_PATTERN = r"^[a-z0-9][a-z0-9.-]*$"
# the largest slice a refusal suggests instead (every family has 256-chip slices)
SUGGEST_MAX_CHIPS = 256


class PlanError(ValueError):
    """Launch Params that do not make a valid run; the message names the Param to change."""


# --------------------------------------------------------------------------- slice types
def check_slice(
    accelerator_type: str, runtime_version: str | None, trainer_hosts: int, backend: str
) -> str:
    """The runtime version to provision the trainer slice with ("": none needed); PlanError.

    cloud_tpu: a Cloud TPU type with trainer.hosts hosts; None is its family's default runtime.
    ray: a Ray slice type (``compute.ray_cluster.slice_shape``) with trainer.hosts hosts, no
    default. local: any type (every job runs on this machine), no default. A given
    runtime_version must look like one on any backend."""
    if backend == "ray":
        hosts = _ray_hosts("accelerator_type", accelerator_type)
        try:  # a Cloud TPU type: one of its family; else NxKIND
            tpu_type(accelerator_type)
            other = _type_with_hosts(accelerator_type, trainer_hosts)
        except UnknownAcceleratorError:
            kind = accelerator_type.rpartition("x")[2]
            other = kind if trainer_hosts == 1 else f"{trainer_hosts}x{kind}"
        _check_hosts(accelerator_type, hosts, trainer_hosts, other)
    if backend == "cloud_tpu":
        try:
            default = tpu_type(accelerator_type).runtime_version
        except UnknownAcceleratorError as e:
            raise PlanError(
                f"accelerator_type: {e}; the cloud_tpu backend provisions Cloud TPU types only"
            ) from None
    if runtime_version is not None and not re.match(RUNTIME_VERSION_PATTERN, runtime_version):
        raise PlanError(
            f"runtime_version: {runtime_version!r} is not a TPU runtime version (lowercase "
            "letters, digits, '.', '-', e.g. 'v2-alpha-tpuv5-lite'); leave it empty (null) for "
            "the accelerator's default"
        )
    if backend != "cloud_tpu":
        return runtime_version or ""
    hosts = slice_hosts(accelerator_type)
    _check_hosts(
        accelerator_type, hosts, trainer_hosts, _type_with_hosts(accelerator_type, trainer_hosts)
    )
    return runtime_version or default


def _check_hosts(accelerator_type: str, hosts: int, trainer_hosts: int, other: str | None) -> None:
    """PlanError unless the trainer slice type has trainer.hosts hosts (``other``: a type of
    trainer.hosts hosts to suggest)."""
    if hosts == trainer_hosts:
        return
    pick = f" or pick a {trainer_hosts}-host type ({other})" if other else ""
    fix = json.dumps({"trainer.hosts": hosts})
    raise PlanError(
        f"accelerator_type: {accelerator_type} has {_hosts(hosts)} but trainer.hosts is "
        f"{trainer_hosts}: set overrides {fix}{pick}"
    )


def _ray_hosts(param: str, accelerator_type: str) -> int:
    """The hosts of a Ray slice type; PlanError naming ``param``."""
    try:
        return slice_shape(accelerator_type).hosts
    except RayBackendError as e:
        raise PlanError(f"{param}: {e}") from None


def _hosts(n: int) -> str:
    return f"{n} host" if n == 1 else f"{n} hosts"


def _chips(n: int) -> str:
    return f"{n} chip" if n == 1 else f"{n} chips"


def _type_with_hosts(accelerator_type: str, hosts: int) -> str | None:
    """The largest type of ``accelerator_type``'s family with ``hosts`` hosts (None: none)."""
    prefix = accelerator_type.rsplit("-", 1)[0]
    best = None
    for n in range(1, 16 * hosts + 1):  # at most 8 chips a host, 2 TensorCores a chip
        try:
            if slice_hosts(f"{prefix}-{n}") == hosts:
                best = f"{prefix}-{n}"
        except UnknownAcceleratorError:
            continue
    return best


def single_host_slice(accelerator_type: str | None, backend: str) -> tuple[str, str]:
    """(accelerator type, runtime version) of the one-host slice a curation or evaluation job
    runs on: on cloud_tpu a 1-host Cloud TPU type booting its family's default runtime; on the
    local backend the type as given ("cpu" by default) and no runtime. PlanError names
    ``accelerator_type``."""
    kind = accelerator_type or "cpu"
    if backend != "cloud_tpu":
        return kind, ""
    try:
        tpu = tpu_type(kind)
    except UnknownAcceleratorError as e:
        raise PlanError(
            f"accelerator_type: {e}; the cloud_tpu backend provisions Cloud TPU types only "
            "(e.g. v5litepod-1)"
        ) from None
    if tpu.hosts != 1:
        raise PlanError(
            f"accelerator_type: {kind} has {_hosts(tpu.hosts)} but this job runs on one: pick a "
            "1-host type (e.g. v5litepod-1, v4-8)"
        )
    return kind, tpu.runtime_version


def worker_slice_layout(
    worker_accelerator_type: str | None, worker_slices: Any, backend: str
) -> WorkerSlices | None:
    """The workers' own slices (``rlax_tasks.plan.topology.WorkerSlices``) the Params ask for
    (``worker_accelerator_type``, ``worker_slices``), or None: the workers run on the trainer
    slice."""
    kind = worker_accelerator_type
    if not kind:
        return None
    count = worker_slices or 1
    if not isinstance(count, int) or count < 1:
        raise PlanError(f"worker_slices: give a number of slices >= 1, got {count!r}")
    if backend == "ray":
        return WorkerSlices(count, _ray_hosts("worker_accelerator_type", kind))
    if backend != "cloud_tpu":
        return WorkerSlices(count, 1)  # a local slice is this machine, one host, whatever type
    try:
        hosts = tpu_type(kind).hosts
    except UnknownAcceleratorError as e:
        raise PlanError(f"worker_accelerator_type: {e}") from None
    return WorkerSlices(count, hosts)


def _on_tpu(cfg: Any, backend: str) -> bool:
    """Whether the run's accelerator jobs initialize the TPU runtime (libtpu)."""
    p = cfg.placement
    return p.platform == "tpu" or (p.platform == "auto" and backend == "cloud_tpu")


def check_worker_slices(cfg: Any, backend: str, layout: WorkerSlices | None) -> None:
    """PlanError naming ``worker_accelerator_type`` when the workers' own TPU slices have several
    hosts: a worker is one process on one host, and libtpu on a host of a multi-host slice waits
    for every host of it (docs/design.md §10: nothing runs on a subset of a multi-host slice)."""
    if layout is None or layout.hosts == 1 or not _on_tpu(cfg, backend):
        return
    total = layout.count * layout.hosts
    raise PlanError(
        f"worker_accelerator_type: a worker runs on one TPU host, and a slice of {layout.hosts} "
        "hosts is one TPU runtime over all of them: pick a 1-host type (e.g. v5p-8, v4-8) with "
        f"worker_slices: {total} for {total} workers"
    )


def evaluation_slice(cfg: Any, backend: str, layout: WorkerSlices | None) -> str:
    """The role of the slice the held-out evaluation runs on (on its host 0): the trainer's,
    except under a trainer over several TPU hosts, which is one libtpu slice over every chip of
    them (a process on one host alone waits for the others): the first worker slice's. Such a
    trainer needs its workers on slices of their own (each on every chip of its host:
    ``placement.separate_worker_hosts``): PlanError naming ``worker_accelerator_type``
    otherwise."""
    if cfg.trainer.hosts == 1 or not _on_tpu(cfg, backend):
        return TRAINER_SLICE
    if layout is None:
        raise PlanError(
            f"worker_accelerator_type: a trainer over {cfg.trainer.hosts} TPU hosts takes every "
            "chip of its slice: give the workers slices of their own (e.g. v5p-8; the held-out "
            "evaluation runs on the first)"
        )
    return worker_slice(0)


def run_slices(
    accelerator_type: str,
    trainer_runtime: str,
    worker_accelerator_type: str | None,
    layout: WorkerSlices | None,
    backend: str,
) -> list[tuple[str, str, str]]:
    """(role, accelerator type, runtime version) of every slice, the trainer's first. A worker
    slice boots ``trainer_runtime`` when of the trainer type's family, else its family's default
    (cloud_tpu; "" on local)."""
    slices = [(TRAINER_SLICE, accelerator_type, trainer_runtime)]
    if layout is None or not worker_accelerator_type:
        return slices
    runtime = ""
    if backend == "cloud_tpu":
        own = tpu_type(worker_accelerator_type)
        same = own.family == tpu_type(accelerator_type).family
        runtime = trainer_runtime if same else own.runtime_version
    slices += [(worker_slice(i), worker_accelerator_type, runtime) for i in range(layout.count)]
    return slices


# --------------------------------------------------------------------------- memory on slices
def check_slice_memory(
    cfg: Any, accelerator_type: str, worker_accelerator_type: str | None
) -> None:
    """Refuses, in one line naming the Param to change, a run whose model does not fit the
    chips of its slices (the trainer over every chip of ``accelerator_type``, each worker on a
    host of ``worker_accelerator_type``), whatever ``placement.accelerator`` says."""
    kind = accelerator_type
    try:
        plan = slice_memory_plan(cfg, kind, worker_accelerator_type or None)
    except ValueError as e:  # a conflicting placement.accelerator, shapes that cannot be read
        raise PlanError(str(e).replace("\n", " ")) from None
    log.info("the run on its slices:\n%s", plan.format(problems=False))
    error = slice_fit_error(plan, kind)
    if error:
        raise PlanError(error)


def _slice_type(param: str, accelerator_type: str) -> Any:
    """tpu_type(accelerator_type), its errors naming ``param``; its family's ACCELERATORS entry
    must exist (the families are named alike)."""
    try:
        t = tpu_type(accelerator_type)
    except UnknownAcceleratorError as e:
        raise UnknownAcceleratorError(f"{param}: {e}") from None
    if t.family not in ACCELERATORS:  # a family tpu_types knows and this table does not
        raise ValueError(f"{param}: {accelerator_type}: no chip memory known for {t.family}")
    return t


def _worker_chips(cfg: Any, worker_type: Any) -> list[int]:
    """Chips of each worker: every chip of one host of ``worker_type``, else the config's device
    list of the worker (none: the mesh's fixed sizes, -1 as 1, as memory_plan counts it)."""
    if is_colocated(cfg):  # the sampler shares the trainer's chips
        return []
    if worker_type is not None:
        return [worker_type.chips_per_host] * cfg.workers.count
    default = math.prod(1 if s == -1 else s for s in cfg.workers.mesh_shape)
    out = []
    for i in range(cfg.workers.count):
        devices = job_devices(cfg, f"worker-{i}")
        out.append(default if devices is None else len(devices))
    return out


def _slice_config(cfg: Any, trainer_type: Any, worker_chips: list[int]) -> Any:
    """``cfg`` rebuilt by the config module to run on Cloud TPU slices (``cfg`` is untouched):
    platform tpu, the trainer on every chip of each host of ``trainer_type``; the workers' chips
    numbered after the trainer's only so that the config's shared-chip check (moot between
    slices) passes. Not for launching. ConfigError when the config cannot run so."""
    # the DAG files import this module (PlanError) at parse time: the run config loads in the task
    from rlax_tasks.config import RunConfig, merge_overrides

    blocks, end = [], trainer_type.chips_per_host
    for n in worker_chips:
        start = -(-end // n) * n  # aligned: a TPU process's chips are a block of its size
        blocks.append(list(range(start, start + n)))
        end = start + n
    overrides = {
        "trainer.hosts": trainer_type.hosts,
        "placement": {
            "platform": "tpu",
            "accelerator": trainer_type.family,
            "hosts": 1,
            "trainer": list(range(trainer_type.chips_per_host)),
            "workers": blocks or None,  # (none: a colocated sampler on the trainer's chips)
            "separate_worker_hosts": False,  # (the blocks above count each worker's chips)
            "memory_fraction": None,
        },
    }
    return RunConfig.from_dict(merge_overrides(cfg.to_dict(), overrides))


def _family_types(accelerator_type: str) -> list[Any]:
    """The slices of ``accelerator_type``'s family with a power of two of chips up to
    SUGGEST_MAX_CHIPS, fewest chips first."""
    t = tpu_type(accelerator_type)
    prefix, n = accelerator_type.rsplit("-", 1)
    per_chip = int(n) // t.chips  # TensorCores a chip where the name counts them
    out, chips = [], 1
    while chips <= SUGGEST_MAX_CHIPS:
        try:
            out.append(tpu_type(f"{prefix}-{chips * per_chip}"))
        except UnknownAcceleratorError:
            pass
        chips *= 2
    return out


def _fitting_trainer_type(cfg: Any, model: Any, trainer_type: Any, worker_chips: list[int]):
    """The smallest larger slice of the family whose trainer fits (None: none up to the cap)."""
    from rlax_tasks.config import ConfigError  # (light import, as in _slice_config)

    memory = ACCELERATORS[trainer_type.family].memory
    for t in _family_types(trainer_type.name):
        if t.chips <= trainer_type.chips:
            continue
        try:
            derived = _slice_config(cfg, t, worker_chips)
        except ConfigError:  # e.g. a fixed trainer.mesh_shape these chips do not split
            continue
        if sum(job_bytes(derived, model, trainer_job(derived))[0].values()) <= memory:
            return t
    return None


def _fitting_worker_type(cfg: Any, model: Any, trainer_type: Any, worker_type: Any):
    """The smallest slice of the workers' family with more chips a host whose worker fits."""
    from rlax_tasks.config import ConfigError  # (light import, as in _slice_config)

    memory = ACCELERATORS[worker_type.family].memory
    for t in _family_types(worker_type.name):
        if t.chips_per_host <= worker_type.chips_per_host:
            continue
        try:
            derived = _slice_config(cfg, trainer_type, _worker_chips(cfg, t))
        except ConfigError:
            continue
        if sum(worker_bytes(derived, model, "worker-0")[0].values()) <= memory:
            return t
    return None


def slice_memory_plan(
    cfg: Any,
    accelerator_type: str,
    worker_accelerator_type: str | None = None,
    model_config: str | None = None,
    offline: bool = False,
) -> MemoryPlan:
    """The memory plan of ``cfg`` on Cloud TPU slices, whatever its placement says: the trainer on
    every chip of ``accelerator_type``, each worker on one host of ``worker_accelerator_type``
    (None: its configured devices, trainer's family), each job against its chip's HBM. Advice names
    the Param (a larger type that fits, when one does); ValueError names the Param or field."""
    from rlax_tasks.config import ConfigError  # (light import, as in _slice_config)

    trainer_type = _slice_type("accelerator_type", accelerator_type)
    worker_type = (
        None
        if worker_accelerator_type is None
        else _slice_type("worker_accelerator_type", worker_accelerator_type)
    )
    named = cfg.placement.accelerator
    for param, t in (("accelerator_type", trainer_type), ("worker_accelerator_type", worker_type)):
        if t is not None and named is not None and named != t.family:
            other = f", or pick a {named} {param}" if ACCELERATORS[named].platform == "tpu" else ""
            raise ValueError(
                f"placement.accelerator: is {named!r} but {param} {t.name} is a {t.family} "
                f"slice: set placement.accelerator to {t.family!r} or leave it out (null){other}"
            )
    worker_chips = _worker_chips(cfg, worker_type)
    try:
        derived = _slice_config(cfg, trainer_type, worker_chips)
    except ConfigError as e:
        on_workers = e.field.startswith(("workers", "placement.workers"))
        param, t = (
            ("worker_accelerator_type", worker_type)
            if on_workers and worker_type is not None
            else ("accelerator_type", trainer_type)
        )
        hosts = f"{t.hosts} hosts × {_chips(t.chips_per_host)}" if t.hosts > 1 else "1 host"
        raise ValueError(
            f"{param}: {t.name} ({_chips(t.chips)}, {hosts}): the config cannot run on it: {e}"
        ) from None
    model, source = resolve_model(derived, model_config, offline=offline)

    trainer_acc = ACCELERATORS[trainer_type.family]
    hosts = f" × {trainer_type.hosts} hosts" if trainer_type.hosts > 1 else ""
    trainer = SliceJob(
        "accelerator_type", trainer_type.name, trainer_acc,
        f"{trainer_type.name}: {_chips(trainer_type.chips_per_host)}{hosts}",
        f"a {trainer_acc.name} chip of {trainer_type.name}",
        job_advice(derived, "trainer", "use a larger accelerator_type"),
    )  # fmt: skip

    def worker(n: int) -> SliceJob:
        if worker_type is None:
            return SliceJob(
                "accelerator_type", trainer_type.name, trainer_acc,
                f"{_chips(n)} of {trainer_acc.name} (as configured)",
                f"a {trainer_acc.name} chip, the family of accelerator_type {trainer_type.name}",
                job_advice(
                    derived, "worker-0",
                    "run the workers on slices of their own (worker_accelerator_type), or give "
                    "each worker more chips (placement.workers)",
                ),
            )  # fmt: skip
        acc = ACCELERATORS[worker_type.family]
        return SliceJob(
            "worker_accelerator_type", worker_type.name, acc,
            f"{worker_type.name}: {_chips(n)}{' of a host' if worker_type.hosts > 1 else ''}",
            f"a {acc.name} chip of {worker_type.name}",
            job_advice(
                derived, "worker-0",
                "use a worker_accelerator_type with more chips a host (each worker runs on one "
                "host of it)",
            ),
        )  # fmt: skip

    lead = trainer_job(derived)  # the job on the trainer slice
    slices = {lead: trainer}
    slices.update({f"worker-{i}": worker(n) for i, n in enumerate(worker_chips)})
    plan = plan_for(derived, model, source, slices)

    # a larger slice that fits, computed, where the advice can name one
    failing = {j.job for j in plan.jobs if j.usable is not None and j.total > j.usable}
    if lead in failing:
        bigger = _fitting_trainer_type(cfg, model, trainer_type, worker_chips)
        fix = (
            f"use a larger accelerator_type ({bigger.name} fits the trainer)"
            if bigger
            else f"use a larger accelerator_type (no {trainer_type.family} slice of up to "
            f"{SUGGEST_MAX_CHIPS} chips fits the trainer as configured)"
        )
        slices[lead] = dataclasses.replace(trainer, advice=job_advice(derived, lead, fix))
    if worker_type is not None and failing - {lead}:
        bigger = _fitting_worker_type(cfg, model, trainer_type, worker_type)
        fix = (
            f"use a worker_accelerator_type with more chips a host ({bigger.name}: "
            f"{_chips(bigger.chips_per_host)} a host fits a worker)"
            if bigger
            else f"use a worker_accelerator_type with more chips a host (none of the "
            f"{worker_type.family} slices of up to {SUGGEST_MAX_CHIPS} chips fits a worker)"
        )
        for job in failing - {lead}:
            slices[job] = dataclasses.replace(slices[job], advice=job_advice(derived, job, fix))
    if failing:
        plan = plan_for(derived, model, source, slices)
    return plan


def slice_fit_error(plan: MemoryPlan, accelerator_type: str | None = None) -> str | None:
    """Why ``plan`` does not fit, in one line (None: it fits): one clause per failing job (workers
    that need the same once), led by the Param that chose its chips, e.g. ``accelerator_type:
    v5litepod-8: trainer needs 41.2 GiB per chip (...) but a v5e chip has 16.0 GiB: use a larger
    accelerator_type (v5litepod-32 fits the trainer) ...``; outside a slice plan the lead is
    ``accelerator_type`` when given, else placement.accelerator."""
    if plan.fits:
        return None
    failing = [j for j in plan.jobs if j.usable is not None and j.total > j.usable]
    clauses, seen = [], []
    for j in failing:
        key = (j.parts, j.usable)
        if key in seen:
            continue
        seen.append(key)
        same = sum((k.parts, k.usable) == key for k in failing) - 1
        who = j.job if not same else f"{j.job} (and {same} other worker{'s' * (same > 1)})"
        on = plan.slices.get(j.job)
        if on is not None:
            lead, unit, advice = f"{on.param}: {on.accelerator_type}", "chip", on.advice
            has = f"a {on.accelerator.name} chip has {format_bytes(on.accelerator.memory)}"
        else:
            lead = (
                f"accelerator_type: {accelerator_type}"
                if accelerator_type
                else f"placement.accelerator: {plan.cfg.placement.accelerator}"
            )
            unit, advice = "device", job_advice(plan.cfg, j.job)
            has = f"it has {format_bytes(j.usable)}"
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in j.parts.items() if v)
        clauses.append(
            f"{lead}: {who} needs {format_bytes(j.total)} per {unit} ({parts}) but {has}: {advice}"
        )
    clauses += [p for p in plan.problems if p.startswith("ps needs")]
    return "; ".join(clauses) or "; ".join(plan.problems)
