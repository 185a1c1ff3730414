"""Specs, handles and states shared by every compute backend.

Specs say what to create (validated on construction: errors name the field); handles say what
was created. Handles are plain dataclasses with ``to_dict``/``from_dict`` so they travel through
Airflow XCom and trigger kwargs as JSON.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

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


@dataclasses.dataclass(frozen=True)
class SliceSpec:
    """What to provision: one accelerator slice (a TPU node, or a local directory)."""

    name: str
    accelerator_type: str = "cpu"
    runtime_version: str = ""
    spot: bool = True
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    zone: str = ""
    project: str = ""

    def __post_init__(self) -> None:
        validate_name("name", self.name)
        if not isinstance(self.accelerator_type, str) or not self.accelerator_type:
            raise ValueError("accelerator_type must be a non-empty string (e.g. 'v5litepod-8')")
        if not isinstance(self.spot, bool):
            raise ValueError(f"spot must be true or false, got {self.spot!r}")
        object.__setattr__(self, "labels", _validate_labels(dict(self.labels or {})))

    @property
    def run_id(self) -> str:
        """The run this slice belongs to (label ``rlax-run-id``; "default" when unlabelled)."""
        return self.labels.get(RUN_ID_LABEL) or "default"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SliceSpec:
        return cls(**_known_fields(cls, d, "SliceSpec"))


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What to run on a slice: ``rlax <argv>`` with extra environment variables."""

    name: str
    argv: list[str]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    run_root: str = ""
    heartbeat_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        validate_name("job name", self.name)
        if isinstance(self.argv, str) or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"argv must be a list of strings, got {self.argv!r}")
        object.__setattr__(self, "argv", list(self.argv))
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError("env must map strings to strings")
        object.__setattr__(self, "env", dict(self.env))
        if not self.heartbeat_timeout_s > 0:
            raise ValueError(
                f"heartbeat_timeout_s must be positive, got {self.heartbeat_timeout_s!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobSpec:
        return cls(**_known_fields(cls, d, "JobSpec"))


@dataclasses.dataclass(frozen=True)
class SliceHandle:
    """A provisioned slice. ``root`` is its control directory (local path or gs:// URI) where
    job specs and job status objects live; ``instance_id`` changes on every (re-)creation."""

    backend: str
    name: str
    root: str
    instance_id: str
    spec: dict[str, Any]
    resource: str = ""  # the cloud resource name (queued resource), "" for local slices

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SliceHandle) -> SliceHandle:
        if isinstance(d, SliceHandle):
            return d
        return cls(**_known_fields(cls, d, "slice handle"))

    @property
    def slice_spec(self) -> SliceSpec:
        return SliceSpec.from_dict(self.spec)


@dataclasses.dataclass(frozen=True)
class JobHandle:
    """A started job: where its status lives (``status_dir``) and the slice it runs on."""

    backend: str
    name: str
    slice: dict[str, Any]
    status_dir: str
    heartbeat_timeout_s: float
    submitted_at: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | JobHandle) -> JobHandle:
        if isinstance(d, JobHandle):
            return d
        return cls(**_known_fields(cls, d, "job handle"))

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
