"""Specs, handles and states shared by every compute backend.

Specs say what to create (validated on construction: errors name the field); handles say what
was created, plain dataclasses with ``to_dict``/``from_dict`` for Airflow XCom as JSON."""

from __future__ import annotations

import dataclasses
import enum
import re
import time
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from rlax_tasks.services.endpoints import HOST_ADDRESS_ENV

# what rlax_tasks.compute exports from here
__all__ = [
    "CAPACITIES",
    "CONFIG_ERROR_EXIT_CODE",
    "COORDINATOR_ADDRESS_ENV",
    "COORDINATOR_PORT_ENV",
    "DEFAULT_COORDINATOR_PORT",
    "HOST_ADDRESS_ENV",
    "MANAGED_LABEL",
    "NUM_PROCESSES_ENV",
    "PROCESS_ID_ENV",
    "RUN_ID_LABEL",
    "WORKER_ID_ENV",
    "JobHandle",
    "JobSpec",
    "JobState",
    "JobStatus",
    "SliceHandle",
    "SliceSpec",
    "SliceState",
]

# label carrying the run id: local slices live under <run_root>/<run_id>/slices/<name>/ and the
# janitor filters on it
RUN_ID_LABEL = "rlax-run-id"
# every slice RLAX creates carries this label, so the janitor never touches foreign resources
MANAGED_LABEL = "rlax-managed"

# slice names become Cloud TPU resource ids: lowercase letters, digits, hyphens
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# Cloud label keys/values: lowercase letters, digits, '_' and '-', at most 63 characters
_LABEL_RE = re.compile(r"^[a-z0-9_-]{0,63}$")


class SliceState(enum.StrEnum):
    """Lifecycle of a slice as the orchestrator sees it."""

    PROVISIONING = "PROVISIONING"
    READY = "READY"
    PREEMPTED = "PREEMPTED"  # taken away by the service (spot): re-provision and resume
    FAILED = "FAILED"  # could not be created (capacity, quota): re-provision may succeed
    DELETED = "DELETED"


class JobState(enum.StrEnum):
    """Lifecycle of a job on a slice."""

    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    PREEMPTED = "PREEMPTED"  # slice lost, process killed, heartbeat missing: retry resumes


# the exit code of `rlax` for a user/configuration error (see rlax_tasks/cli.py)
CONFIG_ERROR_EXIT_CODE = 2

# The environment the node agent (rlax_tasks.compute.agent) gives every job it starts. A job on
# several hosts (JobSpec.hosts) is one process group over them: these are what the trainer reads
# to call jax.distributed.initialize (rlax_tasks/trainer/process_group.py).
WORKER_ID_ENV = "RLAX_WORKER_ID"  # this host's index in its slice
PROCESS_ID_ENV = "RLAX_PROCESS_ID"  # this host's index in JobSpec.hosts (multi-host jobs)
NUM_PROCESSES_ENV = "RLAX_NUM_PROCESSES"  # len(JobSpec.hosts) (multi-host jobs)
COORDINATOR_ADDRESS_ENV = "RLAX_COORDINATOR_ADDRESS"  # "<address of hosts[0]>:<port>"
# the coordinator's port, read from the job's own env (default DEFAULT_COORDINATOR_PORT)
COORDINATOR_PORT_ENV = "RLAX_COORDINATOR_PORT"
DEFAULT_COORDINATOR_PORT = 8482


def validate_name(field: str, value: str) -> str:
    """``value`` if it is a valid slice/job name, else ValueError naming ``field``."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(
            f"{field}={value!r} is not a valid name: use 1-63 lowercase letters, digits and "
            "hyphens, starting with a letter"
        )
    return value


def _validate_labels(labels: dict[str, str]) -> dict[str, str]:
    out = {}
    for k, v in labels.items():
        if not k or not _LABEL_RE.match(str(k)) or not _LABEL_RE.match(str(v)):
            raise ValueError(
                f"labels[{k!r}]={v!r} is invalid: keys and values must be lowercase letters, "
                "digits, '_' or '-', at most 63 characters"
            )
        out[str(k)] = str(v)
    return out


# how a slice's capacity is bought: spot (reclaimable, cheapest), on-demand, or a reservation
CAPACITIES = ("spot", "on-demand", "reserved")


class _Record:
    """``to_dict``/``from_dict`` of a spec or handle dataclass: plain JSON (tuples as lists),
    read back with every field known (an error names the record and the unknown fields)."""

    _what: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        items = dataclasses.asdict(self).items()  # type: ignore[call-overload]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in items}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Self) -> Self:
        if isinstance(d, cls):
            return d
        return cls(**_known_fields(cls, d, cls._what))


def managed_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """``labels`` plus ``MANAGED_LABEL``: what marks a slice as created by RLAX."""
    return {**labels, MANAGED_LABEL: "true"}


def has_labels(labels: Mapping[str, str], want: Mapping[str, str] | None) -> bool:
    """Whether ``labels`` include every key and value of ``want`` (a backend's label filter)."""
    return all(labels.get(k) == v for k, v in (want or {}).items())


@dataclasses.dataclass(frozen=True)
class SliceSpec(_Record):
    """What to provision: one accelerator slice (a TPU node, or a local directory). ``spot`` /
    ``reserved`` (neither: on-demand) buy its capacity; ``service_account`` (an email) is the
    identity its VMs run as; ``network`` / ``subnetwork`` the VPC they join ("": defaults)."""

    name: str
    accelerator_type: str = "cpu"
    runtime_version: str = ""
    spot: bool = True
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    zone: str = ""
    project: str = ""
    reserved: bool = False
    service_account: str = ""
    network: str = ""
    subnetwork: str = ""

    def __post_init__(self) -> None:
        validate_name("name", self.name)
        if not isinstance(self.accelerator_type, str) or not self.accelerator_type:
            raise ValueError("accelerator_type must be a non-empty string (e.g. 'v5litepod-8')")
        for field in ("spot", "reserved"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be true or false, got {getattr(self, field)!r}")
        if self.spot and self.reserved:
            raise ValueError("capacity: a slice is spot or reserved, not both")
        for field in ("service_account", "network", "subnetwork"):
            if not isinstance(getattr(self, field), str):
                raise ValueError(f"{field} must be a string, got {getattr(self, field)!r}")
        if self.service_account and "@" not in self.service_account:
            raise ValueError(
                f"service_account {self.service_account!r}: give the service account's email "
                "(NAME@PROJECT.iam.gserviceaccount.com)"
            )
        object.__setattr__(self, "labels", _validate_labels(dict(self.labels or {})))

    @property
    def capacity(self) -> str:
        """ "spot", "reserved" or "on-demand"."""
        return "spot" if self.spot else "reserved" if self.reserved else "on-demand"

    @staticmethod
    def capacity_fields(capacity: str) -> dict[str, bool]:
        """{"spot", "reserved"} for one of CAPACITIES; ValueError naming the choices."""
        if capacity not in CAPACITIES:
            raise ValueError(f"capacity {capacity!r} is not one of {list(CAPACITIES)}")
        return {"spot": capacity == "spot", "reserved": capacity == "reserved"}

    @property
    def run_id(self) -> str:
        """The run this slice belongs to (label ``rlax-run-id``; "default" when unlabelled)."""
        return self.labels.get(RUN_ID_LABEL) or "default"

    _what = "SliceSpec"

    def managed(self) -> SliceSpec:
        """This spec with ``MANAGED_LABEL`` among its labels (what a backend provisions)."""
        return dataclasses.replace(self, labels=managed_labels(self.labels))


def validate_hosts(field: str, value: Any) -> tuple[int, ...]:
    """``value`` as a tuple of host indices (non-empty, distinct, non-negative ints), else
    ValueError naming ``field``."""
    hosts = tuple(value) if isinstance(value, (list, tuple)) else None
    if (
        not hosts
        or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hosts)
        or len(set(hosts)) != len(hosts)
    ):
        raise ValueError(
            f"{field}={value!r} must be a non-empty list of distinct host indices (ints >= 0), "
            "e.g. [0] or [0, 1]"
        )
    return hosts


def coordinator_port(env: dict[str, str]) -> int:
    """The port of a multi-host job's coordinator: ``RLAX_COORDINATOR_PORT`` in ``env``, or the
    default; ValueError naming the variable when it is not a port number."""
    raw = env.get(COORDINATOR_PORT_ENV, "")
    if raw == "":
        return DEFAULT_COORDINATOR_PORT
    if not (raw.isascii() and raw.isdigit()) or not 0 < int(raw) < 65536:
        raise ValueError(f"env[{COORDINATOR_PORT_ENV!r}]={raw!r} is not a port number (1-65535)")
    return int(raw)


@dataclasses.dataclass(frozen=True)
class JobSpec(_Record):
    """What to run on a slice: ``rlax <argv>`` with extra environment variables.

    ``hosts``: the hosts it runs on (the TPU VM's ``agent-worker-number``); on several it is one
    process group, each given ``RLAX_PROCESS_ID``, ``RLAX_NUM_PROCESSES`` and the coordinator."""

    name: str
    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    run_root: str = ""
    heartbeat_timeout_s: float = 60.0
    hosts: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        validate_name("job name", self.name)
        if isinstance(self.argv, str) or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"argv must be a list of strings, got {self.argv!r}")
        object.__setattr__(self, "argv", list(self.argv))
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError("env must map strings to strings")
        object.__setattr__(self, "env", dict(self.env))
        coordinator_port(self.env)
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(
                f"heartbeat_timeout_s must be positive, got {self.heartbeat_timeout_s!r}"
            )
        object.__setattr__(self, "hosts", validate_hosts("hosts", self.hosts))

    _what = "JobSpec"

    def process_env(self) -> dict[str, str]:
        """The job's environment variables, ``RLAX_RUN_ROOT`` set to ``run_root`` unless ``env``
        sets it."""
        env = dict(self.env)
        if self.run_root:
            env.setdefault("RLAX_RUN_ROOT", self.run_root)
        return env


@dataclasses.dataclass(frozen=True)
class SliceHandle(_Record):
    """A provisioned slice. ``root`` is its control directory (local path or gs:// URI) where
    job specs and job status objects live; ``instance_id`` changes on every (re-)creation."""

    backend: str
    name: str
    root: str
    instance_id: str
    spec: dict[str, Any]
    resource: str = ""  # the cloud resource name (queued resource), "" for local slices

    _what = "slice handle"

    @property
    def slice_spec(self) -> SliceSpec:
        return SliceSpec.from_dict(self.spec)


@dataclasses.dataclass(frozen=True)
class JobHandle(_Record):
    """A started job: where its status lives (``status_dir``; host K > 0 of a multi-host job
    writes ``<status_dir>/worker-K/``) and the slice it runs on."""

    backend: str
    name: str
    slice: dict[str, Any]
    status_dir: str
    heartbeat_timeout_s: float
    submitted_at: float
    hosts: tuple[int, ...] = (0,)  # the slice's hosts it runs on (JobSpec.hosts)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hosts", validate_hosts("hosts", self.hosts))

    _what = "job handle"

    @classmethod
    def submitted(
        cls, backend: str, job: JobSpec, slice_handle: SliceHandle, status_dir: str
    ) -> JobHandle:
        """The handle of ``job`` started now on ``slice_handle``, its status in ``status_dir``."""
        return cls(backend, job.name, slice_handle.to_dict(), status_dir,
                   job.heartbeat_timeout_s, time.time(), job.hosts)  # fmt: skip

    @property
    def slice_handle(self) -> SliceHandle:
        return SliceHandle.from_dict(self.slice)


@dataclasses.dataclass(frozen=True)
class JobStatus:
    """The observed state of a job, with a human-readable reason and the exit code if any."""

    state: JobState
    message: str = ""
    exit_code: int | None = None

    @property
    def is_config_error(self) -> bool:
        """A failure the user must fix (rlax exit code 2): retrying cannot help."""
        return self.state is JobState.FAILED and self.exit_code == CONFIG_ERROR_EXIT_CODE

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state.value, "message": self.message, "exit_code": self.exit_code}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobStatus:
        return cls(JobState(d["state"]), d.get("message", ""), d.get("exit_code"))


def _known_fields(cls: type, d: dict[str, Any], what: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"{what} must be a dict, got {type(d).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{what} has unknown field(s) {unknown}; known: {sorted(names)}")
    return dict(d)


def slice_name(run_id: str, role: str) -> str:
    """A valid slice/job name (lowercase letters, digits, hyphens; ≤ 63) for ``role`` of a run:
    ``rlax-<run id>-<role>``, shortened to fit."""
    base = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-") or "run"
    name = f"rlax-{base}"[: 62 - len(role)].rstrip("-") + f"-{role}"
    if not name[0].isalpha():
        name = "r" + name[1:]
    return name
