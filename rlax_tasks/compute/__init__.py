"""Compute backends: where RLAX jobs run (local processes, or Cloud TPU queued resources).

```python
from rlax_tasks.compute import get_backend, SliceSpec, JobSpec
backend = get_backend("local", run_root="runs")          # or get_backend("cloud_tpu", ...)
handle = backend.provision(SliceSpec(name="w0", labels={"rlax-run-id": "r1"}))  # idempotent
backend.slice_state(handle)            # SliceState: PROVISIONING/READY/PREEMPTED/FAILED/DELETED
job = backend.start_job(handle, JobSpec(name="trainer", argv=["trainer", ...]))  # `rlax <argv>`
# on a multi-host slice (cloud_tpu, e.g. v4-16 = 2 hosts): one process group over its hosts
job = backend.start_job(handle, JobSpec(name="trainer", argv=[...], hosts=(0, 1)))
backend.job_state(job)                 # JobStatus(state=JobState.RUNNING|SUCCEEDED|FAILED|
                                       #           PREEMPTED, message, exit_code)
backend.stop_job(job); backend.teardown(handle)           # teardown is idempotent
backend.list_slices({"rlax-managed": "true"})             # for the janitor
```
Handles are JSON-serialisable (``to_dict``/``from_dict``); every method also accepts the dict.
A job is PREEMPTED when its slice was taken away, its process was killed (SIGKILL/SIGTERM) or its
heartbeat stopped for ``JobSpec.heartbeat_timeout_s``; FAILED with exit code 2 is a
configuration error (``JobStatus.is_config_error``), which retrying cannot fix. A job on several
hosts (``JobSpec.hosts``) gets ``RLAX_PROCESS_ID``, ``RLAX_NUM_PROCESSES`` and
``RLAX_COORDINATOR_ADDRESS`` on each (what ``jax.distributed.initialize`` needs; the names are
``PROCESS_ID_ENV``, ``NUM_PROCESSES_ENV``, ``COORDINATOR_ADDRESS_ENV``); it fails or is
preempted as soon as one host's process does.

This package imports neither JAX nor the Cloud client at import time (the Airflow triggerer
imports it).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

from rlax_tasks.compute import types as _types
from rlax_tasks.compute.types import *  # noqa: F403  (the specs, handles, states, env names)

__all__ = [*_types.__all__, "BACKENDS", "Backend", "get_backend"]

BACKENDS = ("local", "cloud_tpu")


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


def get_backend(name: str = "local", **settings: Any) -> Backend:
    """The backend called ``name`` ("local" or "cloud_tpu") built from its settings."""
    if name == "local":
        from rlax_tasks.compute.local import LocalBackend as cls
    elif name == "cloud_tpu":
        from rlax_tasks.compute.cloud_tpu import CloudTpuBackend as cls
    else:
        raise ValueError(f"backend={name!r} is unknown; choose one of {list(BACKENDS)}")
    known = set(inspect.signature(cls.__init__).parameters) - {"self"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"{name} backend: unknown setting(s) {unknown}; known: {sorted(known)}")
    return cls(**settings)
