"""The run's topology: every job, its command line, environment, addresses and hosts.

One planner for ``rlax run`` and the rlax_train DAG, so a job is described once (docs/design.md
§10): with ``ports`` services get URLs, with ``ports=None`` (slices) they publish their address
under ``run_dir/services/``. The run's token goes into every job's environment. JAX-free."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from rlax_tasks.paramserver.assignment import assign_replica, failover_order
from rlax_tasks.plan.placement import (
    COLOCATED,
    is_colocated,
    job_envs,
    replica_job,
    worker_host,
)
from rlax_tasks.plan.run_plan import TRAINER_SLICE, Job, processes
from rlax_tasks.process.ports import free_port
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths
from rlax_tasks.services.endpoints import service_file
from rlax_tasks.services.http import TOKEN_ENV  # (re-exported: the run's one token)


def worker_slice(index: int) -> str:
    """The role name of the ``index``-th worker slice."""
    return f"workers-{index}"


@dataclasses.dataclass(frozen=True)
class WorkerSlices:
    """Workers on slices of their own: ``count`` slices of ``hosts`` hosts, one worker per host
    (each on its host's devices)."""

    count: int
    hosts: int

    def place(self, worker: int) -> tuple[str, tuple[int, ...]]:
        """(slice role, hosts) of worker ``worker``."""
        return worker_slice(worker // self.hosts), (worker % self.hosts,)


def worker_place(
    cfg: Any, worker: int, worker_slices: WorkerSlices | None = None
) -> tuple[str, tuple[int, ...]]:
    """(slice role, hosts) of worker ``worker``: on its own slice (``worker_slices``), else on
    the trainer slice: with placement.hosts H > 1 on its host (one per device list of
    placement.workers on each), else on host 0."""
    if worker_slices is not None:
        return worker_slices.place(worker)
    return TRAINER_SLICE, (worker_host(cfg, worker),)


@dataclasses.dataclass(frozen=True)
class Ports:
    """The ports the run's services listen on (chosen by the launcher)."""

    ps: int
    trainer: int
    workers: tuple[int, ...]
    coordinator: int  # the trainer group's jax.distributed coordinator (trainer.hosts > 1)
    ps_replicas: tuple[int, ...] = ()  # parameter-server replicas 1.. (replica 0 is ``ps``)


def free_ports(cfg: Any) -> Ports:
    """Ports free on this machine now for every service of ``cfg`` (the jobs bind them soon)."""
    taken: list[int] = []
    replicas = cfg.paramserver.replicas - 1
    for _ in range(cfg.workers.count + 3 + replicas):  # distinct: each is free only on its own
        taken.append(free_port(taken=taken))
    ps, trainer, coordinator, *rest = taken
    workers, ps_replicas = rest[: cfg.workers.count], rest[cfg.workers.count :]
    return Ports(
        ps=ps, trainer=trainer, workers=tuple(workers), coordinator=coordinator,
        ps_replicas=tuple(ps_replicas),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Topology:
    """Every job of a run and the addresses the services are reached at."""

    jobs: list[Job]
    ps_url: str  # replica 0's, where the trainer pushes
    trainer_url: str  # "" in a colocated run (the trainer is inside its one job)
    # worker id → URL or service file (the controller reads them from workers.json)
    workers: dict[str, str]
    coordinator: str | None  # host:port of the trainer group's coordinator (None: the agent's)

    def job(self, name: str) -> Job:
        for job in self.jobs:
            if job.name == name:
                return job
        raise KeyError(f"no job {name!r} in the topology: {[j.name for j in self.jobs]}")

    def processes(self) -> list[tuple[str, Job, dict[str, str]]]:
        """(process name, job, environment) of every process, a multi-host job once per host:
        ``trainer`` (host 0, the one that serves), ``trainer-host1``, ... (followers)."""
        return processes(self.jobs, self.coordinator)


def mesh_arg(cfg: Any) -> str:
    """``--mesh-shape=D,F,T`` of `rlax worker` (one token: a leading -1 is not an option)."""
    return "--mesh-shape=" + ",".join(str(s) for s in cfg.workers.mesh_shape)


def plan_topology(
    cfg: Any,
    steps: int,
    config_path: str,
    ports: Ports | None,
    ps_args: list[str],
    token: str,
    base_env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    worker_slices: WorkerSlices | None = None,
) -> Topology:
    """The jobs of run ``cfg`` for ``steps`` training steps (``ps_args``: the memory plan's
    ``--keep-versions``/``--keep-bytes``), with ``token`` and ``base_env`` in every job's
    environment and each job's own devices (rlax_tasks.plan.placement). ``ports=None``: published
    addresses (see the module docstring); ``worker_slices``: the workers' own slices."""
    if not token:
        raise ValueError(f"no token for the run: every job needs {TOKEN_ENV}")
    n = cfg.workers.count
    if ports is not None and len(ports.workers) != n:
        raise ValueError(f"{len(ports.workers)} worker ports for {n} workers")
    if worker_slices is not None and worker_slices.count * worker_slices.hosts != n:
        raise ValueError(
            f"workers.count is {n} but {worker_slices.count} worker slices of "
            f"{worker_slices.hosts} hosts hold {worker_slices.count * worker_slices.hosts} "
            "workers (one per host)"
        )
    run_dir = cfg.run_dir
    wids = [f"worker-{i}" for i in range(n)]
    replicas = [replica_job(r) for r in range(cfg.paramserver.replicas)]
    if ports is not None and len(ports.ps_replicas) != len(replicas) - 1:
        raise ValueError(f"{len(ports.ps_replicas)} replica ports for {len(replicas) - 1} replicas")
    if ports is not None:
        urls = {
            "ps": f"http://{host}:{ports.ps}",
            **{
                r: f"http://{host}:{p}"
                for r, p in zip(replicas[1:], ports.ps_replicas, strict=True)
            },
            "trainer": f"http://{host}:{ports.trainer}",
            **{w: f"http://{host}:{p}" for w, p in zip(wids, ports.workers, strict=True)},
        }
        listen = {
            name: ["--host", host, "--port", url.rsplit(":", 1)[1]] for name, url in urls.items()
        }
        coordinator: str | None = f"{host}:{ports.coordinator}"
    else:
        urls = {name: service_file(run_dir, name) for name in (*replicas, "trainer", *wids)}
        listen = {name: ["--port", "0", "--publish", path] for name, path in urls.items()}
        coordinator = None
    devices = job_envs(cfg)
    base = {TOKEN_ENV: token, **(base_env or {})}
    s = cfg.staleness
    ps_url = urls["ps"]
    if is_colocated(cfg):  # one process; its parameter server publishes the evaluated versions
        job = Job(
            COLOCATED,
            ["colocated", "--config", config_path, "--steps", str(steps), *listen["ps"],
             *ps_args],
            {**base, **devices[COLOCATED]},
            service=False,
        )  # fmt: skip
        return Topology([job], ps_url, "", {}, coordinator)
    jobs = [
        Job(
            "ps",
            ["ps", "serve", *listen["ps"], "--run-root", run_dir, *ps_args,
             "--worker-timeout", "60"],
            {**base, **devices["ps"]},
        ),
        Job(
            "trainer",
            ["trainer", "--config", config_path, "--ps-url", ps_url, *listen["trainer"]],
            {**base, **devices["trainer"]},
            hosts=tuple(range(cfg.trainer.hosts)),
        ),
    ]  # fmt: skip
    for r, name in enumerate(replicas[1:], start=1):  # relays: no mirror, replica 0 has it
        jobs.insert(r, Job(
            name,
            ["ps", "serve", *listen[name], *ps_args, "--worker-timeout", "60",
             "--replica-id", name, *relay_args(cfg, r, [urls[x] for x in replicas])],
            {**base, **devices[name]},
            hosts=(r % cfg.trainer.hosts,),  # spread over the trainer slice's hosts' links
        ))  # fmt: skip
    for i, wid in enumerate(wids):
        where = dict(zip(("slice", "hosts"), worker_place(cfg, i, worker_slices), strict=True))
        order = failover_order(assign_replica(i, len(replicas)), len(replicas), i)
        home, *others = [urls[replicas[r]] for r in order]
        jobs.append(
            Job(
                wid,
                ["worker", "--model-dir", cfg.model.path, "--ps-url", home, "--worker-id", wid,
                 *(a for u in others for a in ("--ps-failover", u)),
                 *listen[wid], "--dtype", cfg.model.dtype,
                 "--max-slots", str(cfg.workers.slots), "--max-len", str(cfg.workers.max_len),
                 "--reload-every", str(s.reload_every), mesh_arg(cfg),
                 "--support-capacity", str(cfg.rollout.support_size),
                 *([] if cfg.workers.delta_pulls else ["--no-delta-pulls"]),
                 *([] if cfg.workers.interrupt_on_reload else ["--no-interrupt"]),
                 *([] if cfg.workers.decode_layer_copies else ["--no-decode-layer-copies"])],
                {**base, **devices[wid]},
                **where,
            )
        )  # fmt: skip
    jobs.append(
        Job(
            "controller",
            ["controller", "--config", config_path, "--trainer-url", urls["trainer"],
             "--workers-file", workers_file(cfg), "--steps", str(steps)],
            {**base, **devices["controller"]},
            service=False,
        )
    )  # fmt: skip
    workers = {w: urls[w] for w in wids}
    return Topology(jobs, ps_url, urls["trainer"], workers, coordinator)


def relay_args(cfg: Any, replica: int, urls: list[str]) -> list[str]:
    """``--upstream`` flags of replica ``replica`` >= 1 over the replicas' ``urls``: replica 0
    (``star``), or the one before it and then replica 0 (``chain``, docs/design.md §16)."""
    upstreams = [urls[0]]
    if cfg.paramserver.relay == "chain" and replica > 1:
        upstreams.insert(0, urls[replica - 1])
    return [a for u in upstreams for a in ("--upstream", u)]


def workers_file(cfg: Any) -> str:
    """run_dir/workers.json: {worker id: URL}, what the controller dispatches to."""
    return run_paths(cfg.run_dir).workers


def write_workers_file(cfg: Any, topology: Topology) -> str:
    """Writes the workers' addresses for the controller; returns the file's path."""
    path = workers_file(cfg)
    storage.write_bytes(path, json.dumps(topology.workers).encode())
    return path
