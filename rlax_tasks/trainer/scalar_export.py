"""The run's scalars for TensorBoard (``tb/train``, ``tb/eval``: docs/design.md §7) and, when
``WANDB_PROJECT`` is set and ``wandb`` installed, Weights & Biases: the numbers of metrics.jsonl
and lineage.jsonl in the viewers people use. Events are TFRecord-framed here (importing
TensorBoard's writer loads all of ``tensorboard.summary``), one flushed record per step, local
run directories only; a viewer that fails is logged and dropped, never a reason to stop training."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import socket
import struct
import time
from typing import Any

from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import METRICS, run_paths

log = logging.getLogger(__name__)

TRAIN = "train"  # tb/train/: the per-step metrics and lineage scalars
EVAL = "eval"  # tb/eval/: held-out and final evaluations
_SKIP = frozenset({"step", "time"})  # the x axis and the wall clock are not plotted as values
_file_ids = itertools.count()
_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: Any) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def scalar_values(row: dict[str, Any]) -> dict[str, float]:
    """The plottable fields of a metrics row: finite numbers, without "step" and "time"."""
    out = {}
    for key, value in row.items():
        if key in _SKIP or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


def events_dir(run_dir: str, name: str) -> str:
    """``tb/<name>``: one TensorBoard run (``train`` or ``eval``) of the run directory."""
    return storage.join(run_paths(run_dir).tb, name)


def tf_record(data: bytes) -> bytes:
    """``data`` framed as one TFRecord: its length (uint64) and the length's masked CRC32C,
    the data and its masked CRC32C (little-endian)."""
    header = struct.pack("<Q", len(data))
    return header + _masked_crc32c(header) + data + _masked_crc32c(data)


def _masked_crc32c(data: bytes) -> bytes:
    import google_crc32c

    crc = google_crc32c.value(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


class EventFile:
    """One TensorBoard event file, written synchronously: every record is flushed at once."""

    def __init__(self, directory: str, suffix: str = "") -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2

        self._event, self._summary = event_pb2, summary_pb2
        os.makedirs(directory, exist_ok=True)
        name = (
            f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
            f"{os.getpid()}.{next(_file_ids)}{suffix}"
        )
        self.path = os.path.join(directory, name)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._add(self._event.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _add(self, event: Any) -> None:
        self._file.write(tf_record(event.SerializeToString()))
        self._file.flush()

    def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None) -> None:
        """One event at ``step`` holding every value of ``values`` (tag -> number)."""
        value = self._summary.Summary.Value
        summary = self._summary.Summary(
            value=[value(tag=tag, simple_value=v) for tag, v in values.items()]
        )
        self._add(self._event.Event(wall_time=wall_time or time.time(), step=step, summary=summary))

    def restart(self, step: int) -> None:
        """Records a session restart at ``step``: TensorBoard discards earlier files' events at
        ``step`` and after (left by a writer killed between its event and its metrics row)."""
        log_ = self._event.SessionLog(status=self._event.SessionLog.START)
        self._add(self._event.Event(wall_time=time.time(), step=step, session_log=log_))

    def close(self) -> None:
        self._file.close()


class _Wandb:
    """A W&B run, or nothing when W&B is not configured (``WANDB_PROJECT``) or not installed."""

    def __init__(self, run_id: str, suffix: str = "") -> None:
        self.run: Any = None
        project = os.environ.get("WANDB_PROJECT")
        if not project:
            return
        try:
            import wandb
        except ImportError:
            _warn_once("wandb", "WANDB_PROJECT is set but wandb is not installed: no W&B run")
            return
        try:
            self.run = wandb.init(
                project=project, id=run_id + suffix, name=run_id + suffix, group=run_id,
                resume="allow", job_type=suffix.lstrip("-") or "train",
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - W&B must never stop a run
            _warn_once("wandb-init", "W&B run %s not started (%s): no W&B logging", run_id, e)

    def log(self, values: dict[str, float], step: int) -> None:
        if self.run is None:
            return
        try:
            self.run.log(values, step=step)
        except Exception as e:  # noqa: BLE001
            log.warning("W&B logging failed (%s): no more W&B logging in this process", e)
            self.close()

    def define_axis(self, pattern: str, axis: str) -> None:
        if self.run is not None:
            self.run.define_metric(pattern, step_metric=axis)

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            try:
                run.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("W&B run did not finish cleanly: %s", e)


def lineage_scalars(row: dict[str, Any]) -> dict[str, float]:
    """A lineage.jsonl row's staleness (new version - rollout version, per group and per token)
    and dropped groups."""
    out = {
        "dropped/stale": float(len(row.get("dropped_stale") or ())),
        "dropped/zero_variance": float(len(row.get("dropped_zero_variance") or ())),
    }
    version, used = row.get("version"), row.get("rollout_versions") or []
    if isinstance(version, int) and used:
        lags = [version - int(u) for u in used]
        out["staleness/mean"] = sum(lags) / len(lags)
        out["staleness/max"] = float(max(lags))
    counts = [pair for group in row.get("token_versions") or () for pair in group]
    if isinstance(version, int) and counts:  # per token: [version, tokens] pairs of each group
        tokens = sum(int(n) for _, n in counts)
        out["staleness/token_mean"] = sum((version - int(v)) * int(n) for v, n in counts) / tokens
        out["staleness/token_max"] = float(max(version - int(v) for v, _ in counts))
    return out


class StepScalars:
    """The per-step metrics (and each step's lineage) of one run to TensorBoard and W&B.

    ``last_step``: the newest step already in metrics.jsonl (this writer exports later steps
    only). Files are opened at the first write, so a run that trains nothing leaves none.
    ``tensorboard=False``: W&B only (a gs:// run directory)."""

    def __init__(self, run_dir: str, last_step: int = 0, tensorboard: bool = True) -> None:
        self.run_dir, self.last_step, self.tensorboard = run_dir, last_step, tensorboard
        self._lineage = run_paths(run_dir).lineage
        self._lineage_offset = 0
        self._lineage_done = max(0, last_step - 1)  # steps <= this were exported before
        self._file: EventFile | None = None
        self._wandb: _Wandb | None = None
        self._broken = False

    def write(self, step: int, row: dict[str, Any]) -> None:
        """Exports metrics row ``row`` of ``step``, and the lineage of earlier steps."""
        if self._broken or step <= self.last_step:
            return
        values, lineage = scalar_values(row), []
        try:
            if self._wandb is None:
                self._open()
            if self._file is not None:
                self._file.scalars(step, values, wall_time=row.get("time"))
                lineage = self._new_lineage(step)
                for s, scalars in lineage:
                    self._file.scalars(s, scalars)
        except (OSError, ImportError) as e:
            self._broken = True
            log.warning("TensorBoard events of %s not written (%s); metrics.jsonl has them",
                        self.run_dir, e)  # fmt: skip
            return
        self.last_step = step
        if self._wandb is not None:
            extra: dict[str, float] = {}
            if lineage:  # the newest lineage row on its own axis (its step lags by one)
                s, scalars = lineage[-1]
                extra = {**scalars, "lineage/step": float(s)}
            self._wandb.log({**values, **extra}, step=step)

    def _open(self) -> None:
        if self.tensorboard:
            self._file = EventFile(events_dir(self.run_dir, TRAIN))
            if self.last_step:  # a restart: see EventFile.restart
                self._file.restart(self.last_step + 1)
        self._wandb = _Wandb(os.path.basename(self.run_dir.rstrip("/")))
        self._wandb.define_axis("staleness/*", "lineage/step")
        self._wandb.define_axis("dropped/*", "lineage/step")

    def _new_lineage(self, step: int) -> list[tuple[int, dict[str, float]]]:
        """The lineage rows of steps in (exported, ``step``), read from where the last call
        stopped (a line being written is read next time)."""
        try:
            with open(self._lineage, "rb") as f:
                f.seek(self._lineage_offset)
                data = f.read()
        except FileNotFoundError:
            return []
        data = data[: data.rfind(b"\n") + 1]
        self._lineage_offset += len(data)
        out = []
        for line in data.splitlines():
            try:
                row = json.loads(line)
                s = int(row["step"])
            except (ValueError, KeyError, TypeError):
                continue
            if self._lineage_done < s < step:
                out.append((s, lineage_scalars(row)))
                self._lineage_done = s
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.close()


def step_scalars_for(metrics_path: str, last_step: int) -> StepScalars | None:
    """The exporter of a run's metrics.jsonl at ``metrics_path`` (None when that is not a run
    directory's metrics.jsonl; W&B only when the run directory is on GCS)."""
    if os.path.basename(metrics_path) != METRICS:
        return None
    if storage.is_gcs(metrics_path):
        _warn_once(
            "gcs", "no TensorBoard events for gs:// run directory %s (metrics.jsonl and the "
            "RLAX dashboard have every value)", metrics_path.rpartition("/")[0],
        )  # fmt: skip
        return StepScalars(metrics_path.rpartition("/")[0], last_step, tensorboard=False)
    return StepScalars(os.path.dirname(os.path.abspath(metrics_path)), last_step)


def log_scalars(run_dir: str, step: int, scalars: dict[str, Any], group: str) -> bool:
    """Writes ``scalars`` as "<group>/<name>" at ``step`` to ``tb/eval/`` (and W&B's
    ``<run id>-eval`` run). Idempotent: a (group, step) already written is skipped, so a
    re-run evaluation adds no duplicate point. Returns whether anything was written."""
    values = {f"{group}/{k}": v for k, v in scalar_values(scalars).items()}
    if not values:
        return False
    if storage.is_gcs(run_dir):
        _warn_once("gcs-eval", "no TensorBoard events for gs:// run directory %s", run_dir)
        return False
    directory, suffix = events_dir(run_dir, EVAL), f".{group}.{step}"
    try:
        if any(name.endswith(suffix) for name in os.listdir(directory)):
            return False
    except FileNotFoundError:
        pass
    try:
        events = EventFile(directory, suffix)
        events.scalars(step, values)
        events.close()
    except (OSError, ImportError) as e:
        log.warning("TensorBoard events of %s not written (%s)", run_dir, e)
        return False
    wandb = _Wandb(os.path.basename(run_dir.rstrip("/")), suffix="-eval")
    wandb.log(values, step=step)
    wandb.close()
    return True
