"""Compute backends: where RLAX jobs run (local processes, Cloud TPU queued resources, or
placement groups of a Ray cluster).

``get_backend(name, **settings)`` gives a ``Backend``: ``provision`` a slice, ``start_job`` /
``job_state`` / ``stop_job`` on it, ``teardown``. Handles are JSON-serialisable; a job killed or
silent past its heartbeat timeout is PREEMPTED; exit code 2 is a configuration error. JAX-free."""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

from rlax_tasks.compute import types as _types
from rlax_tasks.compute.cloud_tpu import CloudTpuBackend
from rlax_tasks.compute.local import LocalBackend
from rlax_tasks.compute.ray_cluster import RayBackend
from rlax_tasks.compute.types import *  # noqa: F403  (the specs, handles, states, env names)

__all__ = [*_types.__all__, "BACKENDS", "Backend", "get_backend", "setting_names"]

BACKENDS = ("local", "cloud_tpu", "ray")
_CLASSES = {"local": LocalBackend, "cloud_tpu": CloudTpuBackend, "ray": RayBackend}


@runtime_checkable
class Backend(Protocol):
    """What the orchestrator needs from a place that runs jobs."""

    name: str

    def provision(self, spec: _types.SliceSpec) -> _types.SliceHandle: ...

    def slice_state(self, handle: _types.SliceHandle | dict) -> _types.SliceState: ...

    def start_job(
        self, handle: _types.SliceHandle | dict, job: _types.JobSpec
    ) -> _types.JobHandle: ...

    def job_state(self, job: _types.JobHandle | dict) -> _types.JobStatus: ...

    def stop_job(self, job: _types.JobHandle | dict) -> None: ...

    def teardown(self, handle: _types.SliceHandle | dict) -> None: ...

    def list_slices(
        self, label_filter: dict[str, str] | None = None
    ) -> list[_types.SliceHandle]: ...


def setting_names(name: str) -> set[str]:
    """The settings backend ``name`` (one of BACKENDS) takes: its constructor's parameters."""
    if name not in _CLASSES:
        raise ValueError(f"backend={name!r} is unknown; choose one of {list(BACKENDS)}")
    return set(inspect.signature(_CLASSES[name].__init__).parameters) - {"self"}


def get_backend(name: str = "local", **settings: Any) -> Backend:
    """The backend called ``name`` (one of BACKENDS) built from its settings."""
    known = setting_names(name)
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"{name} backend: unknown setting(s) {unknown}; known: {sorted(known)}")
    return _CLASSES[name](**settings)
