"""Controller snapshots (DESIGN §7): written under run_root/<run_id>/snapshots/, committed by a
pointer.

A snapshot is ``<step>.json`` (plus ``<step>.buffer.parquet`` holding the buffered scored groups
when there are any); the ``LATEST`` pointer, naming the file and its sha256, is written last with
``storage.commit_pointer`` (os.replace locally, a generation precondition on GCS). Only what
``LATEST`` names is ever loaded: a crash between writing a snapshot and committing the pointer
leaves the previous snapshot in force. A pointer that moved since this store last read it means
another controller is writing the run, and the write fails instead of overwriting it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
from typing import Any

from rlax_tasks import storage
from rlax_tasks.run_paths import run_paths

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1


class SnapshotError(RuntimeError):
    """A committed snapshot is unreadable or does not match its pointer."""


@dataclasses.dataclass
class Snapshot:
    """The controller's state at a weight-reload boundary.

    ``in_flight``: {"prompt_id", "seq", "worker"} in dispatch order; ``queued``: {"prompt_id",
    "seq"} waiting to be (re-)issued, front first; ``buffer``: ``RolloutBuffer.state_dict()``;
    ``steps``: {"step", "prompt_ids"} consumed by each step since the previous snapshot.
    """

    step: int
    version: int
    seed: int
    mixture: dict[str, Any]
    in_flight: list[dict[str, Any]]
    queued: list[dict[str, Any]]
    buffer: dict[str, Any]
    steps: list[dict[str, Any]]
    counters: dict[str, int]
    # write-ahead record: the prompt ids of the batch the controller is about to train on as
    # step ``step + 1`` (the buffer is the one before that batch was taken). After a crash the
    # restored controller trains exactly this batch first; the trainer treats a step it already
    # applied as a replay, so no step is applied twice and none is lost.
    pending: list[str] | None = None

    @property
    def in_flight_ids(self) -> list[str]:
        return [p["prompt_id"] for p in self.in_flight]

    @property
    def buffered_ids(self) -> list[str]:
        return [g["prompt_id"] for g in self.buffer["groups"]]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _groups_to_parquet(groups: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(groups), out)
    return out.getvalue()


def _groups_from_parquet(data: bytes) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    return pq.read_table(io.BytesIO(data)).to_pylist()


class SnapshotStore:
    """Writes and loads the snapshots of one run directory (local path or gs:// URI)."""

    def __init__(self, run_dir: str, keep: int | None = 5) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        paths = run_paths(run_dir)
        self.dir, self.pointer = paths.snapshots, paths.snapshot_pointer
        self.keep = keep
        self._generation: int | None = None  # of the pointer, as this store last saw it

    def _pointer(self) -> tuple[dict[str, Any] | None, int]:
        data, generation = storage.read_versioned(self.pointer)
        if data is None:
            return None, 0
        try:
            return json.loads(data), generation
        except json.JSONDecodeError as e:
            raise SnapshotError(f"{self.pointer} is not valid JSON: {e}") from e

    def write(self, snapshot: Snapshot) -> str:
        """Writes the snapshot files, then commits the pointer; returns the snapshot's path."""
        if self._generation is None:
            _, self._generation = self._pointer()
        body = dataclasses.asdict(snapshot)
        groups = body["buffer"].pop("groups")
        body["format"] = SNAPSHOT_FORMAT
        body["buffer_file"] = None
        stem = f"{snapshot.step}.pending" if snapshot.pending is not None else f"{snapshot.step}"
        if groups:
            data = _groups_to_parquet(groups)
            name = f"{stem}.buffer.parquet"
            storage.write_bytes(storage.join(self.dir, name), data)
            body["buffer_file"] = {"name": name, "sha256": _sha256(data), "groups": len(groups)}
        payload = json.dumps(body, sort_keys=True).encode()
        name = f"{stem}.json"
        path = storage.join(self.dir, name)
        storage.write_bytes(path, payload)
        pointer = {"step": snapshot.step, "file": name, "sha256": _sha256(payload)}
        try:
            self._generation = storage.commit_pointer(
                self.pointer, json.dumps(pointer).encode(), if_generation_match=self._generation
            )
        except storage.PreconditionFailedError as e:
            raise storage.PreconditionFailedError(
                f"{self.pointer} was moved by someone else (is another controller running this "
                f"run?): {e}"
            ) from e
        log.info("snapshot at step %d committed (%s)", snapshot.step, path)
        self._prune(snapshot.step)
        return path

    def load_latest(self) -> Snapshot | None:
        """The snapshot ``LATEST`` names (verified against its sha256), or None if none."""
        pointer, generation = self._pointer()
        self._generation = generation
        if pointer is None:
            return None
        path = storage.join(self.dir, pointer["file"])
        try:
            payload = storage.read_bytes(path)
        except FileNotFoundError as e:
            raise SnapshotError(f"{self.pointer} names {path}, which does not exist") from e
        if _sha256(payload) != pointer["sha256"]:
            raise SnapshotError(f"{path} does not match the sha256 in {self.pointer}")
        body = json.loads(payload)
        if body.pop("format", None) != SNAPSHOT_FORMAT:
            raise SnapshotError(f"{path}: unknown snapshot format")
        sidecar = body.pop("buffer_file")
        groups: list[dict[str, Any]] = []
        if sidecar is not None:
            spath = storage.join(self.dir, sidecar["name"])
            data = storage.read_bytes(spath)
            if _sha256(data) != sidecar["sha256"]:
                raise SnapshotError(f"{spath} does not match the sha256 in {path}")
            groups = _groups_from_parquet(data)
        body["buffer"]["groups"] = groups
        return Snapshot(**body)

    def _prune(self, committed_step: int) -> None:
        """Deletes snapshot files older than the ``keep`` newest (never the committed one)."""
        if self.keep is None:
            return
        steps = set()
        for name in storage.list_children(self.dir):
            head = name.split(".", 1)[0]
            if head.isdigit():
                steps.add(int(head))
        older = sorted(s for s in steps if s < committed_step)
        for step in older[: max(0, len(older) - (self.keep - 1))]:
            for suffix in (".json", ".buffer.parquet", ".pending.json", ".pending.buffer.parquet"):
                path = storage.join(self.dir, f"{step}{suffix}")
                if storage.exists(path):
                    storage.delete_prefix(path)
