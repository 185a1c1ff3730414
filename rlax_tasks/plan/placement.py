"""Devices per job (docs/design.md §12): the environment that gives each job of a run its own
devices.

``job_envs(cfg)``, used by both launchers, follows the run's ``placement``: on gpu the job's GPUs
and a memory share, on tpu libtpu's per-process variables, on cpu n forced host devices and
CPU_XLA_FLAGS, on auto nothing; ps, controller and verifier always get JAX_PLATFORMS=cpu.
Importable without JAX."""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from rlax_tasks.compute.devices import (  # re-exported: the launchers' names for them
    ACCELERATORS,
    MODES,
    PLATFORMS,
    TPU_CHIP_BOUNDS,
    Accelerator,
    host_memory,
    resolve_mesh,
)
from rlax_tasks.process.device_check import EXPECTED_ENV, expectation_env
from rlax_tasks.utils.byte_sizes import format_bytes

# jobs that never need an accelerator
CPU_JOBS = ("ps", "controller", "verifier")
# share of a GPU's memory the processes on it preallocate together when memory_fraction is unset
# (split evenly: JAX would preallocate 75% in every process, and a second one would fail)
GPU_MEMORY_TOTAL = 0.9
# XLA:CPU flags of every job on cpu devices, unless its XLA_FLAGS set them: the classic fusion
# pipeline compiles a run's programs faster at the same step time (benchmarks/README.md)
CPU_XLA_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
# first libtpu port of the processes on a TPU host (libtpu's own default), one per process
TPU_PORT_BASE = 8476


# --------------------------------------------------------------------------- jobs and devices
COLOCATED = "colocated"  # the one job of a colocated run (trainer, sampler, PS, controller)
HELDOUT = "heldout"  # the held-out evaluation job (`rlax heldout`, started by `rlax run`)


def is_colocated(cfg: Any) -> bool:
    """Whether ``cfg`` runs as one colocated job (placement.mode)."""
    return cfg.placement.mode == COLOCATED


def trainer_job(cfg: Any) -> str:
    """The job on the trainer's devices: ``trainer``, or a colocated run's one job."""
    return COLOCATED if is_colocated(cfg) else "trainer"


def replica_job(index: int) -> str:
    """The job of parameter-server replica ``index``: ``ps`` (replica 0, where the trainer
    pushes), ``ps-1``, ``ps-2``, ... (relays, docs/design.md §16)."""
    return "ps" if index == 0 else f"ps-{index}"


def is_ps_job(job: str) -> bool:
    """Whether ``job`` is a parameter-server replica's job."""
    return re.fullmatch(r"ps(-[1-9]\d*)?", job) is not None


def is_cpu_job(job: str) -> bool:
    """Whether ``job`` never needs an accelerator (CPU_JOBS, every parameter-server replica)."""
    return job in CPU_JOBS or is_ps_job(job)


def job_names(cfg: Any) -> list[str]:
    """The jobs a launcher starts, in start order: ps (and its replicas ps-1..), trainer,
    worker-0..N-1, controller (a colocated run: the one job ``colocated``)."""
    if is_colocated(cfg):
        return [COLOCATED]
    replicas = [replica_job(r) for r in range(cfg.paramserver.replicas)]
    return [*replicas, "trainer", *(f"worker-{i}" for i in range(cfg.workers.count)), "controller"]


def job_devices(cfg: Any, job: str) -> tuple[int, ...] | None:
    """The device indices of ``job`` on its host; None = the platform default (every device
    the host shows; for cpu jobs the host CPU). With ``placement.hosts`` = H, workers.count =
    H × len(placement.workers): worker-i is list i mod len on its host."""
    p = cfg.placement
    if is_cpu_job(job):
        return None
    if job in ("trainer", COLOCATED):
        return p.trainer
    if job == HELDOUT:  # on devices of its own, else the trainer's (when it is not training)
        return p.trainer if p.evaluator is None else p.evaluator
    m = re.fullmatch(r"worker-(\d+)", job)
    if m is None:
        raise ValueError(f"unknown job {job!r}: expected ps, trainer, worker-<i>, controller")
    if p.workers is None:
        return None
    return p.workers[int(m.group(1)) % len(p.workers)]


def _host_lists(cfg: Any) -> list[tuple[int, ...]]:
    """The device lists of the accelerator jobs of one host (trainer first)."""
    p = cfg.placement
    return [x for x in (p.trainer, *(p.workers or ()), p.evaluator) if x is not None]


def sharers(cfg: Any, devices: Sequence[int]) -> int:
    """Processes on the busiest of ``devices`` (trainer and workers of one host)."""
    lists = _host_lists(cfg)
    return max((sum(d in x for x in lists) for d in devices), default=1)


def gpu_memory_fraction(cfg: Any, job: str) -> float | None:
    """XLA_PYTHON_CLIENT_MEM_FRACTION of a GPU job (None: not a GPU job)."""
    p = cfg.placement
    if p.platform != "gpu" or is_cpu_job(job):
        return None
    if p.memory_fraction is not None:
        return p.memory_fraction
    devices = job_devices(cfg, job)
    if devices is None:  # every GPU of a host of its own (separate_worker_hosts): alone there
        return GPU_MEMORY_TOTAL
    return round(GPU_MEMORY_TOTAL / sharers(cfg, devices), 4)


def _ids(devices: Sequence[int]) -> str:
    return ",".join(str(d) for d in devices)


def _tpu_env(cfg: Any, job: str, devices: Sequence[int]) -> dict[str, str]:
    """libtpu's variables for several independent processes on one TPU host (Cloud TPU's recipe).

    libtpu would open every chip of the host as one process of the slice, so a second process
    could not start: each becomes a one-process slice of its own chips (a box of the chip grid,
    see TPU_CHIP_BOUNDS) with a libtpu port of its own (all would take the default otherwise)."""
    if job in ("trainer", COLOCATED):
        slot = 0
    elif job == HELDOUT:  # on chips of its own: after every worker's port
        slot = 0 if cfg.placement.evaluator is None else 1 + cfg.workers.count
    else:
        slot = 1 + int(job.rsplit("-", 1)[1])
    port = TPU_PORT_BASE + slot
    return {
        "TPU_VISIBLE_CHIPS": _ids(devices),
        "TPU_CHIPS_PER_PROCESS_BOUNDS": TPU_CHIP_BOUNDS[len(devices)],
        "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_PROCESS_PORT": str(port),
        "TPU_PROCESS_ADDRESSES": f"localhost:{port}",
        "CLOUD_TPU_TASK_ID": "0",
    }


def _cpu_xla_flags(count: int | None, inherited: str) -> str:
    """``inherited`` XLA_FLAGS with ``count`` forced host devices (None: as inherited) and the
    CPU_XLA_FLAGS it does not set itself."""
    kept = shlex.split(inherited)
    if count is not None:
        kept = [f for f in kept if "xla_force_host_platform_device_count" not in f]
    named = {f.split("=", 1)[0] for f in kept}
    extra = [f for f in CPU_XLA_FLAGS if f.split("=", 1)[0] not in named]
    count_flag = [] if count is None else [f"--xla_force_host_platform_device_count={count}"]
    return " ".join([*kept, *extra, *count_flag])


def job_env(cfg: Any, job: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The device variables of ``job`` (ps, trainer, worker-<i>, controller, verifier).

    ``environ`` (default os.environ) only supplies the XLA_FLAGS a cpu job's flags are added to.
    """
    p = cfg.placement
    devices = job_devices(cfg, job)
    if is_cpu_job(job):
        return {"JAX_PLATFORMS": "cpu"}
    # what the job checks its devices against at start (rlax_tasks.process.device_check)
    expected = expectation_env(p.platform, None if devices is None else len(devices))
    if p.platform == "cpu":
        inherited = (os.environ if environ is None else environ).get("XLA_FLAGS", "")
        count = None if devices is None else len(devices)
        return {"JAX_PLATFORMS": "cpu", **expected, "XLA_FLAGS": _cpu_xla_flags(count, inherited)}
    if p.platform == "auto" or devices is None:
        return expected
    if p.platform == "tpu" and job == "trainer" and cfg.trainer.hosts > 1:
        # one libtpu slice over every chip of every host: libtpu reads its shape (bounds, this
        # host's task id, its peers) from the TPU VM, the same on each host
        return expected
    if p.platform == "gpu":
        return {
            "CUDA_VISIBLE_DEVICES": _ids(devices),
            "XLA_PYTHON_CLIENT_MEM_FRACTION": str(gpu_memory_fraction(cfg, job)),
            **expected,
        }
    return {**_tpu_env(cfg, job, devices), **expected}


def job_envs(cfg: Any, environ: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
    """{job: device variables} for every job a launcher starts (``job_names``)."""
    return {job: job_env(cfg, job, environ) for job in job_names(cfg)}


def job_mesh(cfg: Any, job: str) -> tuple[int, ...] | None:
    """The resolved (data, fsdp[, expert], tensor) mesh of the trainer or a worker (None: device
    count unknown, or a cpu job)."""
    devices = job_devices(cfg, job)
    if is_cpu_job(job) or devices is None:
        return None
    if job in ("trainer", COLOCATED):  # (a colocated sampler: workers.mesh_shape, same devices)
        return resolve_mesh(cfg.trainer.mesh_shape, cfg.trainer.hosts * len(devices))
    return resolve_mesh(cfg.workers.mesh_shape, len(devices))


def worker_host(cfg: Any, worker: int) -> int:
    """The host of worker ``worker`` under a placement over placement.hosts hosts (one worker
    per device list of placement.workers on each); 0 on one host."""
    p = cfg.placement
    if p.hosts == 1:
        return 0
    per_host = len(p.workers) if p.workers else max(1, cfg.workers.count // p.hosts)
    return min(worker // per_host, p.hosts - 1)


def host_devices(cfg: Any, job: str) -> str:
    """``job``'s devices on its host in words, e.g. "gpu 0,1", "gpu 0-3", "cpu"."""
    p = cfg.placement
    devices = job_devices(cfg, job)
    if is_cpu_job(job):
        return "cpu"
    if devices is None:
        return "cpu" if p.platform == "cpu" else f"{p.platform}: every device of the host"
    ids = list(devices)
    text = (
        f"{ids[0]}-{ids[-1]}"
        if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1))
        else _ids(ids)
    )
    return f"{p.platform} {text}"


def describe_devices(cfg: Any, job: str) -> str:
    """``job``'s devices in words, e.g. "gpu 0,1,2,3", "gpu 0-3 × 8 hosts", "cpu"."""
    p = cfg.placement
    text = host_devices(cfg, job)
    if job_devices(cfg, job) is None or is_cpu_job(job):
        return text
    if job == "trainer" and cfg.trainer.hosts > 1:
        text += f" × {cfg.trainer.hosts} hosts"
    elif p.hosts > 1 and job == HELDOUT:
        text += " of host 0"
    elif p.hosts > 1 and p.workers:
        text += f" of host {worker_host(cfg, int(job.rsplit('-', 1)[1]))}"
    return text


def describe(cfg: Any, environ: Mapping[str, str] | None = None) -> str:
    """The placement as a table: each job, its devices, its mesh and its device variables."""
    p = cfg.placement
    acc = ACCELERATORS.get(p.accelerator or "")
    head = f"placement: {p.mode}, platform {p.platform}"
    if acc is not None:
        head += f", {acc.name} ({format_bytes(acc.memory)} per device)"
    head += f", {p.hosts} host{'s' if p.hosts > 1 else ''}"
    if p.mode == COLOCATED:
        head += " (trainer, sampler, parameter server and controller in one process)"
    if p.hosts > 1:
        head += " (the trainer spans them all; each host runs the workers listed)"
    rows = [("job", "devices", "mesh (data,fsdp,tensor)", "environment")]
    envs = job_envs(cfg, environ)
    if p.evaluator is not None:  # the held-out evaluation on devices of its own
        envs[HELDOUT] = job_env(cfg, HELDOUT, environ)
    for job, env in envs.items():
        mesh = job_mesh(cfg, job)
        rows.append(
            (
                job,
                describe_devices(cfg, job),
                "-" if mesh is None else ",".join(map(str, mesh)),
                " ".join(f"{k}={v}" for k, v in env.items() if k != EXPECTED_ENV)
                or "(nothing forced)",
            )
        )
    return "\n".join([head, *_table(rows)])


def _table(rows: list[Sequence[str]], right: Sequence[int] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        out.append("  " + "  ".join(cells).rstrip())
    return out


__all__ = [
    "ACCELERATORS",
    "COLOCATED",
    "CPU_JOBS",
    "GPU_MEMORY_TOTAL",
    "HELDOUT",
    "MODES",
    "PLATFORMS",
    "TPU_CHIP_BOUNDS",
    "Accelerator",
    "describe",
    "describe_devices",
    "gpu_memory_fraction",
    "host_memory",
    "is_colocated",
    "is_cpu_job",
    "is_ps_job",
    "job_devices",
    "job_env",
    "job_envs",
    "job_mesh",
    "job_names",
    "replica_job",
    "resolve_mesh",
    "trainer_job",
]
