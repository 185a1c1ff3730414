"""The run's plan: every job's command line, environment, slice and hosts, and the slices to
provision. `rlax run` launches it and the rlax_train DAG's plan task returns it as its XCom
(``to_dict``), read back by the DAG's tasks (docs/design.md §10). Plain data, JAX-free."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from rlax_tasks.compute.types import COORDINATOR_ADDRESS_ENV as COORDINATOR_ENV
from rlax_tasks.compute.types import NUM_PROCESSES_ENV, PROCESS_ID_ENV
from rlax_tasks.plan.placement import COLOCATED

TRAINER_SLICE = "trainer"


class PlanFormatError(ValueError):
    """A plan dict that is not a plan of this version (a missing, unknown or mistyped key)."""


def _fields(cls: type, raw: Any, where: str) -> dict[str, Any]:
    """``raw``'s values for every field of ``cls``, refusing a missing or unknown key."""
    if not isinstance(raw, Mapping):
        raise PlanFormatError(f"{where}: expected a mapping, got {type(raw).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(names))
    missing = [n for n in names if n not in raw]
    if unknown or missing:
        raise PlanFormatError(
            f"{where}: not a {cls.__name__} ("
            + "; ".join(
                ([f"unknown key(s) {unknown}"] if unknown else [])
                + ([f"missing key(s) {missing}"] if missing else [])
            )
            + f"); its keys are {names}: plan the run again with this RLAX version"
        )
    return {n: raw[n] for n in names}


@dataclasses.dataclass(frozen=True)
class Job:
    """One job of the run: ``rlax <argv>`` with ``env`` on ``hosts`` of slice ``slice``.

    Args:
        name: the job's name (``ps``, ``trainer``, ``worker-0``, ``controller``, ...).
        argv: the `rlax` command line; empty: this run has no such job (its task is skipped).
        env: the job's environment on top of the host's (devices, token, caches).
        slice: the role of the slice it runs on (``trainer``, ``workers-0``, ...).
        hosts: the slice's hosts it spans (one process per host, one process group).
        service: False for a job that finishes (exit 0 = done); services run until stopped.
    """

    name: str
    argv: list[str]
    env: dict[str, str]
    slice: str = TRAINER_SLICE
    hosts: tuple[int, ...] = (0,)
    service: bool = True

    @classmethod
    def unplanned(cls, name: str) -> Job:
        """A job this run does not have (no command line)."""
        return cls(name, [], {})

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``Job.from_dict(job.to_dict()) == job``."""
        return {
            "name": self.name, "argv": list(self.argv), "env": dict(self.env),
            "slice": self.slice, "hosts": list(self.hosts), "service": self.service,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, raw: Any, where: str = "job") -> Job:
        """The job of ``to_dict``; PlanFormatError for a missing or unknown key."""
        values = _fields(cls, raw, where)
        if not isinstance(values["argv"], list | tuple) or not isinstance(values["env"], Mapping):
            raise PlanFormatError(f"{where}: argv must be a list and env a mapping")
        values.update(
            argv=[str(a) for a in values["argv"]],
            env={str(k): str(v) for k, v in values["env"].items()},
            hosts=tuple(int(h) for h in values["hosts"]),
        )
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class SlicePlan:
    """One slice to provision, as ``ProvisionSlicesOperator`` takes it (``to_dict``).

    Args:
        role: what runs on it (``trainer``, ``workers-0``, ...): jobs name it as their slice.
        name: the slice's name (unique per run and role).
        accelerator_type: its type (``cpu``, ``v5litepod-8``, ``gpu-8``, ...).
        runtime_version: its image ("": the family's default, or none on the local backend).
        spot: bought as spot capacity (reclaimable); with ``reserved`` False too: on-demand.
        reserved: from the project's reservation.
        service_account: the identity its VMs run as ("": the default).
        network: the VPC network ("": the default).
        subnetwork: its subnetwork ("": the default).
        evaluation: the held-out evaluations run on its host 0 (else the trainer slice's).
    """

    role: str
    name: str
    accelerator_type: str
    runtime_version: str
    spot: bool = True
    reserved: bool = False
    service_account: str = ""
    network: str = ""
    subnetwork: str = ""
    evaluation: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Any, where: str = "slice") -> SlicePlan:
        return cls(**_fields(cls, raw, where))


@dataclasses.dataclass(frozen=True)
class TrainingPlan:
    """What one run starts: its jobs and, on slices, the slices they run on.

    Built by ``rlax_tasks.plan.launch.plan_jobs``; the rlax_train DAG's plan task adds the
    slices and the held-out job and returns ``to_dict()`` (one XCom key per field, so a task
    argument reads a field: ``plan["trainer"]``); its tasks read it back with ``from_dict``.

    Args:
        run_id: the run's id (its directory under ``run_root``).
        run_root: where runs live (local directory or gs://).
        run_dir: ``run_root/run_id``.
        config_path: the resolved config.yaml every job reads.
        steps: training steps in total (across resumes).
        ps_url: the parameter server's URL, or its service file on slices.
        done_marker: the file whose presence tells the services' watchers the run is done.
        ps: the parameter server's job (unplanned in a colocated run).
        trainer: the trainer's job, over its hosts (unplanned in a colocated run).
        workers: the rollout workers' jobs, one each (none in a colocated run).
        controller: the job whose exit 0 ends the run (a colocated run: its one job).
        heldout: `rlax heldout` beside training (unplanned unless it has devices of its own).
        eval_env: the environment of the evaluations before and after training (their devices).
        coordinator: host:port of the trainer group's coordinator (None on slices).
        slices: the slices to provision (none for `rlax run` on this machine).
        runtime_version: the trainer slice's runtime version ("": none).
        ps_replicas: the parameter-server replicas beside ``ps`` (``ps-1``, ...), which relay
            its versions to their share of the workers (docs/design.md §16).
    """

    run_id: str
    run_root: str
    run_dir: str
    config_path: str
    steps: int
    ps_url: str
    done_marker: str
    ps: Job
    trainer: Job
    workers: tuple[Job, ...]
    controller: Job
    heldout: Job
    eval_env: dict[str, str]
    coordinator: str | None = None
    slices: tuple[SlicePlan, ...] = ()
    runtime_version: str = ""
    ps_replicas: tuple[Job, ...] = ()

    @property
    def colocated(self) -> bool:
        """One process runs everything (the controller's job is the colocated one)."""
        return self.controller.name == COLOCATED

    def jobs(self) -> list[Job]:
        """The run's planned jobs in start order: ps (and its replicas), trainer, workers,
        controller."""
        order = (self.ps, *self.ps_replicas, self.trainer, *self.workers, self.controller)
        return [j for j in order if j.argv]

    def processes(self) -> list[tuple[str, Job, dict[str, str]]]:
        """(process name, job, environment) of every process on this machine (``processes``)."""
        return processes(self.jobs(), self.coordinator)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able (an Airflow XCom): ``TrainingPlan.from_dict(plan.to_dict()) == plan``.

        Returns:
            One key per field; jobs and slices as their own ``to_dict``.
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("ps", "trainer", "controller", "heldout"):
            out[name] = out[name].to_dict()
        out["workers"] = [w.to_dict() for w in self.workers]
        out["ps_replicas"] = [r.to_dict() for r in self.ps_replicas]
        out["slices"] = [s.to_dict() for s in self.slices]
        out["eval_env"] = dict(self.eval_env)
        return out

    @classmethod
    def from_dict(cls, raw: Any) -> TrainingPlan:
        """The plan of ``to_dict``.

        Returns:
            The plan, equal to the one ``raw`` was made from.

        Raises:
            PlanFormatError: a key is missing or unknown (a plan of another RLAX version).
        """
        values = _fields(cls, raw, "plan")
        for name in ("ps", "trainer", "controller", "heldout"):
            values[name] = Job.from_dict(values[name], f"plan[{name!r}]")
        values["workers"] = tuple(
            Job.from_dict(w, f"plan['workers'][{i}]") for i, w in enumerate(values["workers"])
        )
        values["ps_replicas"] = tuple(
            Job.from_dict(r, f"plan['ps_replicas'][{i}]")
            for i, r in enumerate(values["ps_replicas"])
        )
        values["slices"] = tuple(
            SlicePlan.from_dict(s, f"plan['slices'][{i}]") for i, s in enumerate(values["slices"])
        )
        values["eval_env"] = dict(values["eval_env"])
        return cls(**values)


def group_env(coordinator: str, job: Job, index: int) -> dict[str, str]:
    """The process-group variables of the process on ``job.hosts[index]``."""
    return {
        COORDINATOR_ENV: coordinator,
        NUM_PROCESSES_ENV: str(len(job.hosts)),
        PROCESS_ID_ENV: str(index),
    }


def processes(jobs: Iterable[Job], coordinator: str | None) -> list[tuple[str, Job, dict]]:
    """(process name, job, environment) of every process, a multi-host job once per host:
    ``trainer`` (host 0, the one that serves), ``trainer-host1``, ... (followers)."""
    if coordinator is None:
        raise ValueError("processes() needs the ports plan (rlax run); slices run jobs whole")
    out = []
    for job in jobs:
        if len(job.hosts) == 1:
            out.append((job.name, job, job.env))
            continue
        for index in range(len(job.hosts)):
            name = job.name if index == 0 else f"{job.name}-host{index}"
            out.append((name, job, {**job.env, **group_env(coordinator, job, index)}))
    return out
