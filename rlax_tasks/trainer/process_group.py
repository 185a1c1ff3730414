"""The trainer's process group: one ``jax.distributed`` job over every host of its slice
(docs/design.md §10). Host 0 serves and decides; the others follow it through a ``CommandChannel``,
doing every piece of device work in the same order, as multi-controller JAX requires. Settings come
from ``RLAX_COORDINATOR_ADDRESS``, ``RLAX_NUM_PROCESSES`` and ``RLAX_PROCESS_ID`` (else JAX finds
the cluster itself); on CPU, the multi-host simulation, collectives go through gloo."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax
from jax._src import distributed

from rlax_tasks.compute.types import COORDINATOR_ADDRESS_ENV as COORDINATOR_ENV
from rlax_tasks.compute.types import NUM_PROCESSES_ENV, PROCESS_ID_ENV

log = logging.getLogger(__name__)

# seconds without a heartbeat after which the group is torn down (every process exits)
HEARTBEAT_TIMEOUT_ENV = "RLAX_HEARTBEAT_TIMEOUT_S"
DEFAULT_HEARTBEAT_TIMEOUT_S = 30
# a command's payload is stored in pieces of at most this many bytes (gRPC message limits)
_PIECE_BYTES = 32 << 20
_KEY_PREFIX = "rlax/trainer"


class ProcessGroupError(ValueError):
    """The process-group settings are inconsistent (the message names the variable)."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process sits in its group; ``coordinator`` None = let JAX detect the cluster."""

    num_processes: int
    process_id: int
    coordinator: str | None = None

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @classmethod
    def from_env(cls, hosts: int, environ: Mapping[str, str] | None = None) -> ProcessGroup | None:
        """The group of a trainer configured for ``hosts`` hosts; None for a single process."""
        env = os.environ if environ is None else environ
        coordinator = env.get(COORDINATOR_ENV) or None
        count = _int_env(env, NUM_PROCESSES_ENV)
        pid = _int_env(env, PROCESS_ID_ENV)
        if count is None and coordinator is None:
            if hosts > 1:  # a TPU VM / GPU cluster JAX recognises: it knows the rest
                return cls(num_processes=hosts, process_id=-1)
            return None
        if count is None or pid is None or coordinator is None:
            raise ProcessGroupError(
                f"set all of {COORDINATOR_ENV}, {NUM_PROCESSES_ENV} and {PROCESS_ID_ENV} (or none)"
            )
        if count != hosts:
            raise ProcessGroupError(
                f"{NUM_PROCESSES_ENV}={count} but trainer.hosts is {hosts}: start one trainer "
                "process per host of the trainer's slice"
            )
        if not 0 <= pid < count:
            raise ProcessGroupError(f"{PROCESS_ID_ENV}={pid} is not in [0, {count})")
        return cls(num_processes=count, process_id=pid, coordinator=coordinator)

    def initialize(self) -> None:
        """Joins the group (blocks until every process has joined)."""
        platforms = os.environ.get("JAX_PLATFORMS", "")
        if platforms == "cpu" or (not platforms and _only_cpu()):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        heartbeat = int(os.environ.get(HEARTBEAT_TIMEOUT_ENV) or DEFAULT_HEARTBEAT_TIMEOUT_S)
        if self.coordinator is None:
            jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
        else:
            jax.distributed.initialize(
                coordinator_address=self.coordinator,
                num_processes=self.num_processes,
                process_id=self.process_id,
                heartbeat_timeout_seconds=heartbeat,
            )
        log.info(
            "joined the trainer's process group: process %d of %d, %d of %d devices here",
            jax.process_index(),
            jax.process_count(),
            jax.local_device_count(),
            jax.device_count(),
        )


def _only_cpu() -> bool:
    return not any(importlib.util.find_spec(m) for m in ("libtpu", "jax_cuda12_plugin"))


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw in (None, ""):
        return None
    try:
        return int(raw)
    except ValueError:
        raise ProcessGroupError(f"{name}={raw!r} is not an integer") from None


class CommandChannel:
    """Host 0 → every host, in order: ``send(command, payload)`` / ``receive()``.

    Commands travel through the ``jax.distributed`` key-value store (the coordinator's, on host
    0): command n is a JSON header plus a payload in pieces. Each command ends with ``done(n)``,
    a barrier of the whole group, after which host 0 deletes it: the store holds one command."""

    def __init__(self, poll_s: float = 60.0) -> None:
        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError("CommandChannel needs jax.distributed.initialize() first")
        self.process_id = jax.process_index()
        self.poll_ms = int(poll_s * 1000)
        self.seq = 0

    def _key(self, seq: int, what: str) -> str:
        return f"{_KEY_PREFIX}/{seq}/{what}"

    def send(self, command: dict[str, Any], payload: bytes = b"") -> int:
        """Host 0: publishes the next command; returns its number."""
        self.seq += 1
        n = self.seq
        pieces = [payload[i : i + _PIECE_BYTES] for i in range(0, len(payload), _PIECE_BYTES)]
        for i, piece in enumerate(pieces):
            self.client.key_value_set_bytes(self._key(n, f"piece/{i}"), piece)
        header = {**command, "pieces": len(pieces)}
        self.client.key_value_set(self._key(n, "header"), json.dumps(header))
        return n

    def receive(self) -> tuple[int, dict[str, Any], bytes]:
        """Another host: waits (as long as it takes) for the next command."""
        n = self.seq + 1
        while True:
            try:
                raw = self.client.blocking_key_value_get(self._key(n, "header"), self.poll_ms)
                break
            except Exception as e:  # noqa: BLE001 - jaxlib raises its own error on a timeout
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise
        header = json.loads(raw)
        payload = b"".join(
            self.client.blocking_key_value_get_bytes(self._key(n, f"piece/{i}"), self.poll_ms)
            for i in range(header.pop("pieces"))
        )
        self.seq = n
        return n, header, payload

    def done(self, seq: int, timeout_s: float = 3600.0) -> None:
        """Every host finished command ``seq``; host 0 then deletes it from the store."""
        self.client.wait_at_barrier(f"{_KEY_PREFIX}/{seq}/done", int(timeout_s * 1000))
        if self.process_id == 0:
            self.client.key_value_delete(f"{_KEY_PREFIX}/{seq}/")
