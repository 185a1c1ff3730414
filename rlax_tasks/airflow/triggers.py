"""Deferrable-operator triggers: poll a job's or a slice's state from the Airflow triggerer.

Both rebuild the backend from ``(backend_name, backend_settings)`` in ``run()`` and call its
blocking methods in a thread, so one triggerer watches many jobs. Events are JSON: ``{"state",
"message", "exit_code", "job"}`` or ``{"state", "message", "slice"}``. No JAX, no cloud client."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from airflow.triggers.base import BaseTrigger, TriggerEvent

from rlax_tasks.compute import JobState, SliceState, get_backend
from rlax_tasks.rundir import storage

log = logging.getLogger(__name__)
STATUS_EVERY_S = 60.0


@dataclasses.dataclass(eq=False, repr=False)
class _PollingTrigger(BaseTrigger):
    """Polls ``self._observe()`` until it returns an event payload. The base of the triggers:
    it owns the settings every trigger shares (the backend and how to poll it) and
    ``serialize()``, which gives back each constructor field, so a subclass declares its own
    settings once, as fields. ``poll_interval_s`` None: the class's ``default_poll_s``."""

    default_poll_s: ClassVar[float] = 10.0

    backend_name: str
    backend_settings: dict[str, Any] | None
    poll_interval_s: float | None = dataclasses.field(default=None, kw_only=True)
    max_consecutive_errors: int = dataclasses.field(default=5, kw_only=True)

    def __post_init__(self) -> None:
        BaseTrigger.__init__(self)
        self.backend_settings = dict(self.backend_settings or {})
        poll_s = self.default_poll_s if self.poll_interval_s is None else self.poll_interval_s
        self.poll_interval_s = float(poll_s)
        self.max_consecutive_errors = int(self.max_consecutive_errors)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """(this class's import path, every constructor field): the triggerer rebuilds it."""
        path = f"{type(self).__module__}.{type(self).__qualname__}"
        return path, {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def _observe(self, backend: Any) -> dict[str, Any] | None:
        raise NotImplementedError

    def _error_event(self, message: str) -> dict[str, Any]:
        raise NotImplementedError

    def _describe(self) -> str:
        return type(self).__name__

    async def run(self) -> AsyncIterator[TriggerEvent]:
        backend = get_backend(self.backend_name, **self.backend_settings)
        errors = 0
        started = last_status = time.monotonic()
        while True:
            if time.monotonic() - last_status >= STATUS_EVERY_S:  # a line to show progress
                last_status = time.monotonic()
                log.info("%s: still waiting after %.0fs", self._describe(), last_status - started)
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


@dataclasses.dataclass(eq=False, repr=False)
class JobStateTrigger(_PollingTrigger):
    """Fires once the job is no longer RUNNING, once the run is complete (DONE: the ``done_marker``
    object exists, checked first, or the ``done_when`` job succeeded), or once a sibling job was
    down past ``sibling_grace_s`` (SIBLING_LOST: ``dag.test()`` runs triggers one at a time, so a
    watcher that kept waiting would block the dead job's task); ERROR after repeated failures."""

    job_handle: dict[str, Any]
    done_when: dict[str, Any] | None = None
    siblings: list[dict[str, Any]] | None = None
    sibling_grace_s: float = 600.0
    done_marker: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.job_handle = dict(self.job_handle)
        self.done_when = dict(self.done_when) if self.done_when else None
        self.done_marker = self.done_marker or None
        self.siblings = [dict(h) for h in self.siblings or []]
        self.sibling_grace_s = float(self.sibling_grace_s)
        self._down_since: dict[str, float] = {}

    def _observe(self, backend: Any) -> dict[str, Any] | None:
        if self.done_marker is not None:
            if storage.exists(self.done_marker):
                return self._event("DONE", f"{self.done_marker} exists: the run is complete")
        status = backend.job_state(self.job_handle)
        if status.state is not JobState.RUNNING:
            return {**status.to_dict(), "job": self.job_handle}
        if self.done_when is not None:
            if backend.job_state(self.done_when).state is JobState.SUCCEEDED:
                name = self.done_when.get("name", "?")
                return self._event("DONE", f"job {name} succeeded: the run is complete")
        now = time.monotonic()
        for sibling in self.siblings:
            name = sibling.get("name", "?")
            state = backend.job_state(sibling).state
            if state is JobState.RUNNING:
                self._down_since.pop(name, None)
                continue
            down = now - self._down_since.setdefault(name, now)
            if down >= self.sibling_grace_s:
                return self._event(
                    "SIBLING_LOST",
                    f"job {name} has been {state.value} for {down:.0f}s without a restart",
                )
        return None

    def _event(self, state: str, message: str) -> dict[str, Any]:
        return {"state": state, "message": message, "exit_code": None, "job": self.job_handle}

    def _describe(self) -> str:
        return f"job {self.job_handle.get('name', '?')} running"

    def _error_event(self, message: str) -> dict[str, Any]:
        return {"state": "ERROR", "message": message, "exit_code": None, "job": self.job_handle}


@dataclasses.dataclass(eq=False, repr=False)
class SliceReadyTrigger(_PollingTrigger):
    """Fires once the slice has left PROVISIONING (READY, or lost while provisioning)."""

    default_poll_s: ClassVar[float] = 15.0

    slice_handle: dict[str, Any]

    def __post_init__(self) -> None:
        super().__post_init__()
        self.slice_handle = dict(self.slice_handle)

    def _observe(self, backend: Any) -> dict[str, Any] | None:
        state = backend.slice_state(self.slice_handle)
        if state is SliceState.PROVISIONING:
            return None
        return {"state": state.value, "message": f"slice {state.value}", "slice": self.slice_handle}

    def _error_event(self, message: str) -> dict[str, Any]:
        return {"state": "ERROR", "message": message, "slice": self.slice_handle}
