"""Per-step metrics as JSON lines: ``metrics.jsonl``, one object per step with a "step" key."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np


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
    """Appends one JSON object per step to ``path`` (a local file), flushed at every write."""

    def __init__(self, path: str) -> None:
        if "://" in path:
            raise ValueError(
                f"metrics path {path!r} must be a local file (remote run roots keep metrics "
                "locally and mirror them)"
            )
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.last_step = _last_step_cutting_a_torn_line(path)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Appends {"step": step, **metrics}; a step already written (a step replayed after a
        restart from an older checkpoint) keeps its first row."""
        if step <= self.last_step:
            return
        self.last_step = int(step)
        record = {"step": int(step)}
        record.update({k: to_json_value(v) for k, v in metrics.items()})
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, sort_keys=False) + "\n")
            fh.flush()


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
    for line in reversed(data[:end].splitlines()):  # rows are written in step order
        try:
            return int(json.loads(line).get("step", 0))
        except (ValueError, AttributeError):
            continue
    return 0


def read_metrics(path: str) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (skips a torn last line left by a crash)."""
    out = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out
