"""The trainer as a passive service of the controller (docs/design.md §2, §7): step s's batch,
POSTed to ``/v1/steps/<s>``, is applied only at step s − 1 and version s pushed before the answer; a
step already applied is answered as a replay, which keeps the controller's snapshot exact after any
crash. Checkpoints every ``trainer.checkpoint_every`` steps and on a clean stop; restarted behind,
it answers 409 with ``trainer_step`` and the controller sends the missing steps again."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
from typing import Any

import numpy as np

from rlax_tasks.paramserver.client import VersionConflictError
from rlax_tasks.process.garbage_collection import collect_if_due
from rlax_tasks.rundir.paths import run_paths
from rlax_tasks.services.endpoints import Endpoint
from rlax_tasks.services.http import TOKEN_ENV, JsonClient, Reply
from rlax_tasks.services.protocol import (
    StepAheadError,
    StepConflictError,
    StepReplayedError,
    TrainerBehindError,
)

log = logging.getLogger(__name__)

# TOKEN_ENV: RLAX_PS_TOKEN, the run's one token (rlax_tasks.services.http)
# the body limit without a run configuration to size it from (``batch_body_limit``)
DEFAULT_MAX_BODY_BYTES = 1 << 30
# scalars sent beside a batch's arrays (the controller's per-step counts, e.g. prompts skipped):
# written to that step's metrics row, never trained on
STAT_PREFIX = "stat_"
# StepConflictError, TrainerBehindError: defined in rlax_tasks.services.protocol


class TrainerService:
    """Wraps a ``Trainer``: idempotent steps by number, a push per step in the compute dtype
    (what workers hold, docs/design.md §6), a re-push when the PS lacks the version. Multi-host
    (``channel`` given): host 0 serves and decides, and sends each piece of device work (a step,
    a push, the final checkpoint) through the channel; the others ``follow()`` in the same order,
    each pushing its own shards."""

    def __init__(
        self,
        trainer: Any,
        ps: Any | None = None,
        repush_every_s: float = 5.0,
        channel: Any | None = None,
    ) -> None:
        self.trainer, self.ps = trainer, ps
        self.repush_every_s = repush_every_s
        self.channel = channel
        self.lock = threading.Lock()
        self.last_metrics: dict[str, Any] | None = None
        self._stop = threading.Event()

    @property
    def step(self) -> int:
        return self.trainer.step_count

    @property
    def is_leader(self) -> bool:
        """Host 0 (or the only host): serves the controller and sends the group's work."""
        return self.channel is None or self.channel.process_id == 0

    def start(self) -> TrainerService:
        """Restores the newest complete checkpoint (every host) and publishes its version."""
        restored = self.trainer.restore_latest()
        log.info("trainer at step %d (%s)", self.step, "restored" if restored else "fresh")
        if self.ps is not None and self.is_leader:
            try:
                self.ensure_published()
            except (ConnectionError, TimeoutError) as e:  # the PS may be restarting
                log.warning("parameter server not reachable (%s); publishing later", e)
            threading.Thread(target=self._repush_loop, name="trainer-repush", daemon=True).start()
        return self

    def stop(self) -> None:
        """Checkpoints the steps since the last checkpoint (a clean stop loses none), closes;
        on a multi-host trainer, on every host."""
        self._stop.set()
        with self.lock:
            self._group_work("stop", {})

    def follow(self) -> None:
        """A host other than 0: does the work host 0 sends, until it sends ``stop``."""
        while True:
            seq, command, payload = self.channel.receive()
            op = command.pop("op")
            batch = decode_batch(payload) if payload else None
            try:
                self._execute(op, command, batch)
            except ValueError as e:  # the same deterministic refusal as on host 0
                log.warning("%s %s refused: %s", op, command, e)
            finally:
                self.channel.done(seq)
            if op == "stop":
                return

    def _group_work(
        self, op: str, args: dict[str, Any], batch: dict[str, np.ndarray] | None = None
    ) -> Any:
        """Device work: sent to the other hosts first (multi-host), then done here."""
        if self.channel is None:
            return self._execute(op, args, batch)
        payload = _encode_batch(batch) if batch is not None else b""
        seq = self.channel.send({"op": op, **args}, payload)
        try:
            return self._execute(op, args, batch)
        finally:
            self.channel.done(seq)

    def _execute(self, op: str, args: dict[str, Any], batch: dict[str, np.ndarray] | None) -> Any:
        if op == "step":
            return self._apply(int(args["step"]), batch or {})
        if op == "push":
            return self._push(int(args["version"]))
        if op == "stop":
            if self.step > self.trainer.saved_step:
                self.trainer.save()
            self.trainer.close()
            return None
        raise ValueError(f"unknown trainer command {op!r}")

    def ensure_published(self) -> None:
        """Pushes the current version when the parameter server does not hold it."""
        with self.lock:
            latest = self.ps.latest_version()
            if latest is None or latest < self.step:
                self._group_work("push", {"version": self.step})
                log.info("pushed version %d (the parameter server had %s)", self.step, latest)

    def _push(self, version: int) -> None:
        self.ps.push(version, self._published_params())

    def _published_params(self) -> Any:
        """The current weights as the parameter server carries them: in the compute dtype."""
        # loads JAX: the trainer process (`rlax trainer`, run/trainer_process.py) has it loaded
        from rlax_tasks.models.policy import cast_params

        policy = self.trainer.policy()
        return cast_params(policy.params, policy.dtype)

    def _record_sync(self, step: int, seconds: float) -> None:
        """Appends the push time of a version to run_dir/weight_sync.jsonl (for the plots)."""
        run_dir = self.trainer.run_dir
        if "://" in run_dir or not self.is_leader:
            return
        with open(run_paths(run_dir).weight_sync, "a") as f:
            f.write(json.dumps({"step": step, "push_s": round(seconds, 4)}) + "\n")

    def _repush_loop(self) -> None:
        while not self._stop.wait(self.repush_every_s):
            try:
                self.ensure_published()
            except (ConnectionError, TimeoutError, OSError, RuntimeError) as e:
                log.warning("parameter server check failed: %s", e)

    def train(self, step: int, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """Applies step ``step`` (or answers a replay); returns {"version", "replayed", metrics}."""
        with self.lock:
            if step <= self.step:
                if step < self.step:
                    raise StepConflictError(
                        f"step {step} is older than the trainer's step {self.step}: the "
                        "controller's snapshot is behind the trainer's checkpoint by more than "
                        "one step"
                    )
                return {"version": step, "replayed": True, "metrics": self.last_metrics}
            if step != self.step + 1:
                raise StepAheadError(
                    self.step,
                    f"step {step} cannot follow the trainer's step {self.step}: send steps "
                    f"{self.step + 1}-{step - 1} first (the trainer restarted from an older "
                    "checkpoint)",
                )
            metrics = self._group_work("step", {"step": step}, batch)
            self.last_metrics = metrics
            return {"version": step, "replayed": False, "metrics": metrics}

    def _apply(self, step: int, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """One training step and its push (on every host of the group)."""
        arrays = {k: v for k, v in batch.items() if not k.startswith(STAT_PREFIX)}
        stats = {
            k[len(STAT_PREFIX) :]: float(v) for k, v in batch.items() if k.startswith(STAT_PREFIX)
        }
        if "completion_mask" not in arrays and "mask" in arrays:
            arrays["completion_mask"] = arrays.pop("mask")
        # checkpoints every trainer.checkpoint_every
        metrics = self.trainer.step(arrays, extra_metrics=stats)
        if self.ps is not None:
            t0 = time.perf_counter()
            try:
                self._push(step)
            except VersionConflictError:  # a replayed step: published before the restart
                log.info("the parameter server already holds version %d", step)
            except (ConnectionError, TimeoutError) as e:  # the re-push loop publishes it
                log.warning("push of version %d failed (%s); the re-push loop retries", step, e)
            else:
                metrics["push_s"] = time.perf_counter() - t0
                self._record_sync(step, metrics["push_s"])
        # after the step, on every host of the group (the followers never pass through
        # train()): see rlax_tasks.process.garbage_collection
        collect_if_due()
        return metrics


def _encode_batch(batch: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **batch)
    return buf.getvalue()


class BatchTooLargeError(ValueError):
    """A batch whose arrays would unpack to more bytes than the service takes."""


def decode_batch(payload: bytes, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    """The arrays of an .npz body; BatchTooLargeError, before unpacking any, when they would
    take more than ``max_bytes`` (a small compressed body can unpack to gigabytes)."""
    with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
        unpacked = sum(info.file_size for info in npz.zip.infolist())
        if max_bytes is not None and unpacked > max_bytes:
            raise BatchTooLargeError(
                f"the batch unpacks to {unpacked} bytes, over this trainer's limit of {max_bytes}"
            )
        return {k: npz[k] for k in npz.files}


def batch_body_limit(rows: int, max_len: int) -> int:
    """The body limit of a trainer whose batches have ``rows`` sequences of at most ``max_len``
    tokens: room for 16 [rows, max_len] arrays of 4 bytes (a batch sends 4, plus ``stat_``
    scalars) and 1 MiB of framing."""
    return (1 << 20) + 16 * 4 * rows * max_len


class TrainerClient:
    """The controller's ``TrainStep``: sends a batch, retrying while the trainer restarts."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout_s: float = 600.0,
        give_up_after_s: float = 1800.0,
        retry_s: float = 1.0,
    ) -> None:
        # a URL, or the service file the trainer publishes its address to (followed)
        self.endpoint, self.timeout_s = Endpoint(url), timeout_s
        self.give_up_after_s, self.retry_s = give_up_after_s, retry_s
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.last: dict[str, Any] | None = None
        # connection failures and transient statuses (5xx, 408, 429) are retried every retry_s
        # until give_up_after_s: a restarting trainer answers again
        self.http = JsonClient(
            self.endpoint, self.token, timeout_s=timeout_s, retries=None,
            give_up_after_s=give_up_after_s, backoff_s=retry_s, max_backoff_s=retry_s,
            retry_status=_transient, refused=self._refused, unreachable=self._unreachable,
            retry_log_level=logging.WARNING,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return str(self.endpoint)

    def train(self, step: int, arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """POSTs step ``step``; connection failures are retried (the step is idempotent).

        A replay answer is returned as it is when this call had sent the step before (an
        attempt whose answer was lost), else raised: ``StepReplayedError``, since this call
        never sent the step before (the controller knows whether a restart explains it)."""
        what = f"step {step}"
        reply = self.http.send("POST", f"/v1/steps/{step}", _encode_batch(arrays), what=what)
        if reply.status >= 300:
            raise self._refused(reply, what)
        self.last = answer = reply.json()
        if answer.get("replayed") and reply.attempts == 1:
            raise StepReplayedError(step, int(answer["version"]), answer.get("metrics"))
        if answer.get("replayed"):
            log.info("step %d: applied by an earlier attempt whose answer was lost", step)
        return answer

    def _refused(self, reply: Reply, what: str) -> Exception:
        """409 with ``trainer_step``: restarted from an older checkpoint (TrainerBehindError:
        replay first); any other 4xx is ours to fix (RuntimeError, no retry)."""
        behind = _trainer_step(reply.text) if reply.status == 409 else None
        if behind is not None:
            return TrainerBehindError(behind, reply.text)
        hint = ""
        if reply.status in (401, 403):
            hint = f": give every job of the run the same {TOKEN_ENV}"
        return RuntimeError(
            f"trainer {self.url} refused {what} (HTTP {reply.status}): {reply.text}{hint}"
        )

    def _unreachable(self, error: Exception, what: str) -> Exception:
        return ConnectionError(f"trainer {self.url} unreachable for {what}: {error}")

    def __call__(self, batch: Any) -> int:
        """``TrainStep`` for the controller: a ``Batch`` producing ``batch.version``."""
        return int(self.train(batch.version, step_arrays(batch))["version"])


def step_arrays(batch: Any) -> dict[str, np.ndarray]:
    """A controller ``Batch`` as the trainer takes it: its arrays, and its per-step counts as
    ``stat_`` scalars (written to the step's metrics row, never trained on)."""
    stats = {f"{STAT_PREFIX}{k}": np.float64(v) for k, v in batch.stats().items()}
    return {**batch.arrays(), **stats}


def _transient(status: int) -> bool:
    """A status worth sending the step again for: the trainer's failure, not the request's."""
    return status >= 500 or status in (408, 429)


def _trainer_step(detail: str) -> int | None:
    """``trainer_step`` of a 409 answer from ``TrainerBehindError``, else None."""
    try:
        body = json.loads(detail).get("detail")
    except (ValueError, AttributeError):
        return None
    step = body.get("trainer_step") if isinstance(body, dict) else None
    return step if isinstance(step, int) else None
