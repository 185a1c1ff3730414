"""Per-step metrics as JSON lines: ``metrics.jsonl``, one object per step with a "step" key.
A local file is appended to and flushed at every step; a GCS object, which cannot be appended
to, is rewritten whole by a background thread at most every ``flush_every_s`` (and at close),
so a step costs no request. The same numbers go to TensorBoard (and W&B): ``scalar_export``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import weakref
from typing import Any

import numpy as np

from rlax_tasks.rundir import storage
from rlax_tasks.trainer.scalar_export import step_scalars_for

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 5.0  # the longest a gs:// metrics row waits before it is uploaded


def to_json_value(x: Any) -> Any:
    """A JSON-friendly scalar: jax/numpy scalars -> float/int, NaN/inf -> None."""
    if isinstance(x, bool | int | str) or x is None:
        return x
    arr = np.asarray(x)
    if arr.ndim == 0:
        if np.issubdtype(arr.dtype, np.integer):
            return int(arr)
        v = float(arr)
        return v if math.isfinite(v) else None
    return [to_json_value(v) for v in arr.tolist()]


class MetricsWriter:
    """Writes one JSON object per step to ``path``: a local file or a gs:// object."""

    def __init__(self, path: str, flush_every_s: float = FLUSH_EVERY_S) -> None:
        if "://" in path and not storage.is_gcs(path):
            raise ValueError(f"metrics path {path!r}: a local file or gs://BUCKET/... object")
        self.path = path
        self._remote: _RemoteRows | None = None
        if storage.is_gcs(path):
            self._remote = _RemoteRows(path, flush_every_s)
            self.last_step = self._remote.last_step
            # the last rows reach GCS even when nobody calls close (interpreter exit included)
            self._finalizer = weakref.finalize(self, self._remote.close)
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.last_step = _last_step_cutting_a_torn_line(path)
        # TensorBoard (local run directories) and W&B, for a run directory's metrics.jsonl
        self._scalars = step_scalars_for(path, self.last_step)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Adds {"step": step, **metrics}; a step already written (a step replayed after a
        restart from an older checkpoint) keeps its first row."""
        if step <= self.last_step:
            return
        self.last_step = int(step)
        record = {"step": int(step)}
        record.update({k: to_json_value(v) for k, v in metrics.items()})
        if self._scalars is not None:  # before the row: a kill in between replays the step,
            self._scalars.write(step, record)  # and the replay supersedes this event
        line = json.dumps(record, sort_keys=False) + "\n"
        if self._remote is not None:
            self._remote.append(line.encode("utf-8"))
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()

    def flush(self) -> None:
        """Uploads the rows not on GCS yet (a local file is always flushed)."""
        if self._remote is not None:
            self._remote.flush()

    def close(self) -> None:
        """Writes the last rows and stops the background upload; the writer is done."""
        if self._scalars is not None:
            self._scalars.close()
        if self._remote is not None:
            self._finalizer()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RemoteRows:
    """The bytes of a gs:// metrics object, uploaded whole by a background thread when changed.

    Holds no reference to its ``MetricsWriter``, so that the writer can be collected (and its
    finalizer write the last rows)."""

    def __init__(self, path: str, flush_every_s: float) -> None:
        self.path, self.flush_every_s = path, flush_every_s
        try:
            data = storage.read_bytes(path)
        except FileNotFoundError:
            data = b""
        self._data = bytearray(data[: data.rfind(b"\n") + 1])  # a torn last line is dropped
        self.last_step = _last_step(self._data)
        self._dirty = len(self._data) != len(data)
        self._lock = threading.Lock()  # guards _data and _dirty
        self._upload_lock = threading.Lock()  # one upload at a time, in order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def append(self, line: bytes) -> None:
        with self._lock:
            if self._stop.is_set():
                raise RuntimeError(f"metrics writer for {self.path} is closed")
            self._data += line
            self._dirty = True
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="metrics-upload", daemon=True
                )
                self._thread.start()

    def flush(self) -> None:
        with self._upload_lock:
            with self._lock:
                if not self._dirty:
                    return
                data, self._dirty = bytes(self._data), False
            try:
                storage.write_bytes(self.path, data)
            except BaseException:
                with self._lock:
                    self._dirty = True  # the next flush tries again
                raise

    def _run(self) -> None:
        while not self._stop.wait(self.flush_every_s):
            try:
                self.flush()
            except Exception as e:  # noqa: BLE001 - a network error must not stop training
                log.warning("metrics: could not write %s (%s); retrying", self.path, e)

    def close(self) -> None:
        with self._lock:
            self._stop.set()
            thread = self._thread
        if thread is not None:
            thread.join()
        self.flush()


def _last_step(data: bytes | bytearray) -> int:
    """The step of the last complete row of JSONL bytes (0 for none)."""
    for line in reversed(bytes(data).splitlines()):  # rows are written in step order
        try:
            return int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError):
            continue
    return 0


def _last_step_cutting_a_torn_line(path: str) -> int:
    """The step of the file's last complete row (0 for none); a last line without its newline
    (a crash mid-write) is cut off first, so appends start clean."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb+") as fh:
        data = fh.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            fh.truncate(end)
    return _last_step(data[:end])


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file or gs:// object (skips a torn last line)."""
    out = []
    for line in storage.read_bytes(path).decode("utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
