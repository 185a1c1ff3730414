"""Deferrable-operator triggers: poll a job's or a slice's state from the Airflow triggerer.

Both triggers rebuild the backend from ``(backend_name, backend_settings)`` inside ``run()`` and
call its blocking methods in a thread (``asyncio.to_thread``), so one triggerer process watches
many jobs. This module imports only Airflow's trigger base and ``rlax_tasks.compute`` (no JAX,
no cloud client at import time), as the triggerer requires.

Event payloads (JSON):
- ``JobStateTrigger``: ``{"state": "SUCCEEDED"|"FAILED"|"PREEMPTED"|"ERROR", "message",
  "exit_code", "job": <job handle dict>}``. ERROR: the state could not be read
  ``max_consecutive_errors`` times in a row (the operator retries).
- ``SliceReadyTrigger``: ``{"state": "READY"|"PREEMPTED"|"FAILED"|"DELETED"|"ERROR", "message",
  "slice": <slice handle dict>}``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from rlax_tasks.compute import JobState, SliceState, get_backend

log = logging.getLogger(__name__)


class _PollingTrigger(BaseTrigger):
    """Polls ``self._observe()`` until it returns an event payload."""

    def __init__(
        self,
        backend_name: str,
        backend_settings: dict[str, Any] | None = None,
        poll_interval_s: float = 10.0,
        max_consecutive_errors: int = 5,
    ) -> None:
        super().__init__()
        self.backend_name = backend_name
        self.backend_settings = dict(backend_settings or {})
        self.poll_interval_s = float(poll_interval_s)
        self.max_consecutive_errors = int(max_consecutive_errors)

    def _common_kwargs(self) -> dict[str, Any]:
        return {
            "backend_name": self.backend_name,
            "backend_settings": self.backend_settings,
            "poll_interval_s": self.poll_interval_s,
            "max_consecutive_errors": self.max_consecutive_errors,
        }

    def _observe(self, backend: Any) -> dict[str, Any] | None:
        raise NotImplementedError

    def _error_event(self, message: str) -> dict[str, Any]:
        raise NotImplementedError

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(self.backend_name, **self.backend_settings)
        errors = 0
        while True:
            try:
                event = await asyncio.to_thread(self._observe, backend)
                errors = 0
            except Exception as e:  # noqa: BLE001 - API/storage hiccups: retry a few times
                errors += 1
                log.warning("state poll failed (%d in a row): %s", errors, e)
                if errors >= self.max_consecutive_errors:
                    yield TriggerEvent(self._error_event(f"{type(e).__name__}: {e}"))
                    return
                event = None
            if event is not None:
                yield TriggerEvent(event)
                return
            await asyncio.sleep(self.poll_interval_s)


class JobStateTrigger(_PollingTrigger):
    """Fires once the job is no longer RUNNING (succeeded, failed, or preempted)."""

    def __init__(
        self,
        backend_name: str,
        backend_settings: dict[str, Any] | None,
        job_handle: dict[str, Any],
        poll_interval_s: float = 10.0,
        max_consecutive_errors: int = 5,
    ) -> None:
        super().__init__(backend_name, backend_settings, poll_interval_s, max_consecutive_errors)
        self.job_handle = dict(job_handle)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "rlax_tasks.airflow.triggers.JobStateTrigger",
            {**self._common_kwargs(), "job_handle": self.job_handle},
        )

    def _observe(self, backend: Any) -> dict[str, Any] | None:
        status = backend.job_state(self.job_handle)
        if status.state is JobState.RUNNING:
            return None
        return {**status.to_dict(), "job": self.job_handle}

    def _error_event(self, message: str) -> dict[str, Any]:
        return {"state": "ERROR", "message": message, "exit_code": None, "job": self.job_handle}


class SliceReadyTrigger(_PollingTrigger):
    """Fires once the slice has left PROVISIONING (READY, or lost while provisioning)."""

    def __init__(
        self,
        backend_name: str,
        backend_settings: dict[str, Any] | None,
        slice_handle: dict[str, Any],
        poll_interval_s: float = 15.0,
        max_consecutive_errors: int = 5,
    ) -> None:
        super().__init__(backend_name, backend_settings, poll_interval_s, max_consecutive_errors)
        self.slice_handle = dict(slice_handle)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "rlax_tasks.airflow.triggers.SliceReadyTrigger",
            {**self._common_kwargs(), "slice_handle": self.slice_handle},
        )

    def _observe(self, backend: Any) -> dict[str, Any] | None:
        state = backend.slice_state(self.slice_handle)
        if state is SliceState.PROVISIONING:
            return None
        return {"state": state.value, "message": f"slice {state.value}", "slice": self.slice_handle}

    def _error_event(self, message: str) -> dict[str, Any]:
        return {"state": "ERROR", "message": message, "slice": self.slice_handle}
