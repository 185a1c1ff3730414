"""The run's topology: every job, its command line, environment, addresses and hosts.

One planner for both launchers — ``rlax run`` (local processes under a supervisor) and the
rlax_train DAG (jobs on slices through a compute backend) — so a job is described once:

    topo = plan_topology(cfg, steps, config_path, free_ports(cfg), ps_args, token)
    topo.jobs          # [Job(name, argv, env, slice, hosts)], in start order
    topo.processes()   # [(process name, job, env)]: one per host of a multi-host job

A run is a trainer slice (the trainer over ``trainer.hosts`` hosts, the parameter server and the
controller beside its host 0) and its workers (DESIGN §10). A job on several hosts is one
``jax.distributed`` group: each of its processes gets RLAX_COORDINATOR_ADDRESS (host 0's address
and the group's port), RLAX_NUM_PROCESSES and RLAX_PROCESS_ID (rlax_tasks.trainer.process_group).
Importable without JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlax_tasks import storage
from rlax_tasks.compute.types import COORDINATOR_ADDRESS_ENV as COORDINATOR_ENV
from rlax_tasks.compute.types import NUM_PROCESSES_ENV, PROCESS_ID_ENV
from rlax_tasks.run.placement import job_envs

TOKEN_ENV = "RLAX_PS_TOKEN"
TRAINER_SLICE = "trainer"


@dataclasses.dataclass(frozen=True)
class Ports:
    """The ports the run's services listen on (chosen by the launcher)."""

    ps: int
    trainer: int
    workers: tuple[int, ...]
    coordinator: int  # the trainer group's jax.distributed coordinator (trainer.hosts > 1)


def free_ports(cfg: Any) -> Ports:
    """Ports free on this machine now for every service of ``cfg`` (the jobs bind them soon)."""
    from rlax_tasks.run.supervisor import free_port

    return Ports(
        ps=free_port(),
        trainer=free_port(),
        workers=tuple(free_port() for _ in range(cfg.workers.count)),
        coordinator=free_port(),
    )


@dataclasses.dataclass(frozen=True)
class Job:
    """One job of the run: ``rlax <argv>`` with ``env`` on ``hosts`` of slice ``slice``."""

    name: str
    argv: list[str]
    env: dict[str, str]
    slice: str = TRAINER_SLICE
    hosts: tuple[int, ...] = (0,)
    # False: the job may finish (exit 0 = done, the controller); services run until stopped
    service: bool = True


@dataclasses.dataclass(frozen=True)
class Topology:
    """Every job of a run and the addresses the services are reached at."""

    jobs: list[Job]
    ps_url: str
    trainer_url: str
    workers: dict[str, str]  # worker id → URL (the controller reads them from workers.json)
    coordinator: str  # host:port of the trainer group's coordinator

    def job(self, name: str) -> Job:
        for job in self.jobs:
            if job.name == name:
                return job
        raise KeyError(f"no job {name!r} in the topology: {[j.name for j in self.jobs]}")

    def processes(self) -> list[tuple[str, Job, dict[str, str]]]:
        """(process name, job, environment) of every process, a multi-host job once per host:
        ``trainer`` (host 0, the one that serves), ``trainer-host1``, ... (followers)."""
        out = []
        for job in self.jobs:
            if len(job.hosts) == 1:
                out.append((job.name, job, job.env))
                continue
            for index in range(len(job.hosts)):
                name = job.name if index == 0 else f"{job.name}-host{index}"
                out.append((name, job, {**job.env, **group_env(self.coordinator, job, index)}))
        return out


def group_env(coordinator: str, job: Job, index: int) -> dict[str, str]:
    """The process-group variables of the process on ``job.hosts[index]``."""
    return {
        COORDINATOR_ENV: coordinator,
        NUM_PROCESSES_ENV: str(len(job.hosts)),
        PROCESS_ID_ENV: str(index),
    }


def mesh_arg(cfg: Any) -> str:
    """``--mesh-shape=D,F,T`` of `rlax worker` (one token: a leading -1 is not an option)."""
    return "--mesh-shape=" + ",".join(str(s) for s in cfg.workers.mesh_shape)


def plan_topology(
    cfg: Any,
    steps: int,
    config_path: str,
    ports: Ports,
    ps_args: list[str],
    token: str,
    base_env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
) -> Topology:
    """The jobs of run ``cfg`` for ``steps`` training steps (``ps_args``: the memory plan's
    ``--keep-versions``/``--keep-bytes``), with ``token`` and ``base_env`` in every job's
    environment and each job's own devices (rlax_tasks.run.placement)."""
    if len(ports.workers) != cfg.workers.count:
        raise ValueError(f"{len(ports.workers)} worker ports for {cfg.workers.count} workers")
    run_dir = cfg.run_dir
    ps_url = f"http://{host}:{ports.ps}"
    trainer_url = f"http://{host}:{ports.trainer}"
    workers = {f"worker-{i}": f"http://{host}:{p}" for i, p in enumerate(ports.workers)}
    devices = job_envs(cfg)
    base = {TOKEN_ENV: token, **(base_env or {})}
    s = cfg.staleness
    jobs = [
        Job(
            "ps",
            ["ps", "serve", "--port", str(ports.ps), "--run-root", run_dir, *ps_args,
             "--worker-timeout", "60"],
            {**base, **devices["ps"]},
        ),
        Job(
            "trainer",
            ["trainer", "--config", config_path, "--ps-url", ps_url,
             "--port", str(ports.trainer)],
            {**base, **devices["trainer"]},
            hosts=tuple(range(cfg.trainer.hosts)),
        ),
        *(
            Job(
                wid,
                ["worker", "--model-dir", cfg.model.path, "--ps-url", ps_url, "--worker-id", wid,
                 "--port", url.rsplit(":", 1)[1], "--dtype", cfg.model.dtype,
                 "--max-slots", str(cfg.workers.slots), "--max-len", str(cfg.workers.max_len),
                 "--reload-every", str(s.reload_every), mesh_arg(cfg)],
                {**base, **devices[wid]},
            )
            for wid, url in workers.items()
        ),
        Job(
            "controller",
            ["controller", "--config", config_path, "--trainer-url", trainer_url,
             "--workers-file", workers_file(cfg), "--steps", str(steps)],
            {**base, **devices["controller"]},
            service=False,
        ),
    ]  # fmt: skip
    return Topology(jobs, ps_url, trainer_url, workers, f"{host}:{ports.coordinator}")


def workers_file(cfg: Any) -> str:
    """run_dir/workers.json: {worker id: URL}, what the controller dispatches to."""
    return storage.join(cfg.run_dir, "workers.json")


def write_workers_file(cfg: Any, topology: Topology) -> str:
    """Writes the workers' addresses for the controller; returns the file's path."""
    import json

    path = workers_file(cfg)
    storage.write_bytes(path, json.dumps(topology.workers).encode())
    return path
