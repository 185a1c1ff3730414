"""Notices: what a component must tell the person watching the run, whose log nobody reads.

One JSON line per notice in ``run_dir/notices.jsonl`` (``post``); ``rlax run`` and ``rlax
airflow train`` print new ones once each (``read_since``). Kinds: "fallback", "warning",
"fatal" (the message says what to do). JAX-free; a failed write is logged, never raised."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

log = logging.getLogger(__name__)

KINDS = ("fallback", "warning", "fatal")


@dataclasses.dataclass(frozen=True)
class Notice:
    """One line of notices.jsonl."""

    kind: str
    message: str
    source: str
    time: float

    def format(self) -> str:
        """The terminal line: ``[fallback] controller: <message>``."""
        return f"[{self.kind}] {self.source}: {self.message}"


def post(run_dir: str, kind: str, message: str, source: str = "") -> None:
    """Appends a notice (``source``: the component, default the process's RLAX_JOB_NAME)."""
    if kind not in KINDS:
        raise ValueError(f"notice kind {kind!r}: one of {', '.join(KINDS)}")
    source = source or os.environ.get("RLAX_JOB_NAME", "") or "rlax"
    line = json.dumps({"kind": kind, "message": message, "source": source, "time": time.time()})
    path = run_paths(run_dir).notices
    try:
        if storage.is_gcs(path):  # an object cannot be appended to: rewrite it (notices are rare)
            old = storage.read_bytes(path) if storage.exists(path) else b""
            storage.write_bytes(path, old + line.encode() + b"\n")
        else:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "a", encoding="utf-8") as f:
                f.write(line + "\n")
    except OSError as e:  # a full disk must not turn a notice into a crash
        log.warning("notice not written to %s (%s): %s", path, e, message)
    log.warning("%s", message)


def read_since(run_dir: str, offset: int = 0) -> tuple[list[Notice], int]:
    """The complete notices after byte ``offset``, and the offset to read from next time."""
    path = run_paths(run_dir).notices
    try:
        data = storage.read_bytes(path) if storage.exists(path) else b""
    except OSError:
        return [], offset
    chunk = data[offset:]
    end = chunk.rfind(b"\n") + 1  # a line being written is read next time
    notices = []
    for raw in chunk[:end].splitlines():
        try:
            row: dict[str, Any] = json.loads(raw)
            notices.append(
                Notice(str(row["kind"]), str(row["message"]), str(row.get("source", "")),
                       float(row.get("time", 0.0)))
            )  # fmt: skip
        except (ValueError, KeyError, TypeError):
            continue  # a torn or foreign line: skip it, keep reading
    return notices, offset + end
