"""Controller snapshots (docs/design.md §7): ``snapshots/<step>.json`` (and a buffer Parquet file),
committed by the ``LATEST`` pointer with its sha256, written last; a pointer moved by another
controller fails the write. When what ``LATEST`` names does not verify, the damaged files are
set aside (renamed, never deleted), the newest older snapshot that verifies is loaded and
committed, and a "fallback" notice says so."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import re
import time
from typing import Any

from rlax_tasks.rundir import notices, storage
from rlax_tasks.rundir.paths import run_paths

log = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1
DAMAGED_TAG = ".damaged-"  # a damaged file is renamed <name>.damaged-<time>
_SNAPSHOT_NAME = re.compile(r"^(\d+)(\.pending)?\.json$")


class SnapshotError(RuntimeError):
    """A committed snapshot is unreadable or does not match its pointer."""


class NoIntactSnapshotError(SnapshotError, ValueError):
    """No snapshot of the run verifies (a ValueError: ``rlax`` exits 2, restarting won't help)."""


class _Damaged(Exception):
    """A snapshot file that does not verify (the message says why)."""


@dataclasses.dataclass
class Snapshot:
    """The controller's state at a weight-reload boundary.

    ``in_flight``: {"prompt_id", "seq", "worker"} in dispatch order; ``queued``: {"prompt_id",
    "seq"} waiting to be (re-)issued, front first; ``buffer``: ``RolloutBuffer.state_dict()``;
    ``steps``: {"step", "prompt_ids"} consumed by each step since the previous snapshot."""

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
    # partial rollouts: per sample of an in-flight or queued group, what it held when last
    # asked ({"prompt_id", **SampleProgress.to_dict()}); resumed, not generated again
    partials: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def in_flight_ids(self) -> list[str]:
        return [p["prompt_id"] for p in self.in_flight]

    @property
    def buffered_ids(self) -> list[str]:
        return [g["prompt_id"] for g in self.buffer["groups"]]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _body_sha256(body: dict[str, Any]) -> str:
    """The sha256 a snapshot carries of itself: of its body without that field, as written."""
    return _sha256(json.dumps(body, sort_keys=True).encode())


def _order(name: str) -> tuple[int, int] | None:
    """(step, 1 for a pending snapshot else 0) of a snapshot file name: a step's pending
    snapshot is written after its full one; None for other names."""
    m = _SNAPSHOT_NAME.match(name)
    return None if m is None else (int(m.group(1)), 1 if m.group(2) else 0)


_FILES = (".json", ".buffer.parquet", ".partials.parquet")  # a snapshot's files
_OPTIONAL = ("pending", "partials")  # (snapshots written before partial rollouts have none)
_REQUIRED = [f.name for f in dataclasses.fields(Snapshot) if f.name not in _OPTIONAL]


def _groups_to_parquet(groups: list[dict[str, Any]]) -> bytes:
    import pyarrow.parquet as pq  # (pyarrow loads on first use, not at start-up)

    out = io.BytesIO()
    pq.write_table(_table(groups), out)
    return out.getvalue()


def _table(rows: list[dict[str, Any]]) -> Any:
    """``rows`` as ``pyarrow.Table.from_pylist`` builds them (the first row's columns), typed
    by the first row when every row fits its types: inferring the types from every value is
    most of the time a snapshot of a large buffer or fleet takes to become a table."""
    import pyarrow as pa  # (pyarrow loads on first use, not at start-up)

    try:
        schema = pa.Table.from_pylist(rows[:1]).schema
        return pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in schema.names}, schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return pa.Table.from_pylist(rows)  # a row a first row's types do not fit (None, [])


def _groups_from_parquet(data: bytes) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # (pyarrow loads on first use, not at start-up)

    return pq.read_table(io.BytesIO(data)).to_pylist()


class SnapshotStore:
    """Writes and loads the snapshots of one run directory (local path or gs:// URI)."""

    def __init__(self, run_dir: str, keep: int | None = 5) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be >= 1 or None, got {keep}")
        paths = run_paths(run_dir)
        self.run_dir = run_dir
        self.dir, self.pointer = paths.snapshots, paths.snapshot_pointer
        self.keep = keep
        self._generation: int | None = None  # of the pointer, as this store last saw it

    def write(self, snapshot: Snapshot) -> str:
        """Writes the snapshot files, then commits the pointer; returns the snapshot's path."""
        if self._generation is None:
            _, self._generation = storage.read_versioned(self.pointer)
        # the fields are plain JSON data already: a shallow copy (dataclasses.asdict would
        # deep-copy every buffered group's token lists)
        body = {f.name: getattr(snapshot, f.name) for f in dataclasses.fields(snapshot)}
        body["buffer"] = dict(snapshot.buffer)  # its groups go to a file, not into the body
        groups = body["buffer"].pop("groups")
        body["format"] = SNAPSHOT_FORMAT
        body["buffer_file"] = None
        stem = f"{snapshot.step}.pending" if snapshot.pending is not None else f"{snapshot.step}"
        if groups:
            data = _groups_to_parquet(groups)
            name = f"{stem}.buffer.parquet"
            storage.write_bytes(storage.join(self.dir, name), data)
            body["buffer_file"] = {"name": name, "sha256": _sha256(data), "groups": len(groups)}
        partials = body.pop("partials")
        if partials:
            data = _groups_to_parquet(partials)
            name = f"{stem}.partials.parquet"
            storage.write_bytes(storage.join(self.dir, name), data)
            body["partials_file"] = {"name": name, "sha256": _sha256(data), "rows": len(partials)}
        body["sha256"] = _body_sha256(body)  # lets the file verify without the pointer
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
        """The newest committed snapshot that verifies (damaged ones set aside, the newest older
        one that verifies committed instead), or None when none was committed;
        ``NoIntactSnapshotError`` when none verifies."""
        data, self._generation = storage.read_versioned(self.pointer)
        if data is None:
            return None
        problems: list[str] = []
        newest: tuple[int, int] | None = None  # the order of the file LATEST names
        try:
            pointer = json.loads(data)
            name, sha = str(pointer["file"]), str(pointer["sha256"])
            newest = _order(name)
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as e:
            problems.append(f"{self._rel(self.pointer)} is unreadable ({e})")
            problems[-1] += self._set_aside(self.pointer, copy=True)
        else:
            try:
                return self._load_file(name, sha)
            except _Damaged as e:
                problems.append(f"{self._rel(self.pointer)} names {name}, which {e}")
                aside = self._set_aside_snapshot(name)
                problems[-1] += aside or self._set_aside(self.pointer, copy=True)
        for name in self._candidates(newest):
            try:
                snap = self._load_file(name, None)
            except _Damaged as e:
                problems.append(f"{self._rel(storage.join(self.dir, name))} {e}")
                problems[-1] += self._set_aside_snapshot(name)
                continue
            self._commit(name)
            notices.post(
                self.run_dir,
                "fallback",
                f"{'; '.join(problems)}; resuming from {self._rel(storage.join(self.dir, name))} "
                f"(step {snap.step}), the newest snapshot that verifies",
                source="controller",
            )
            return snap
        message = (
            f"{'; '.join(problems)}; no older snapshot under {self.dir} verifies. Move "
            f"{self.dir} aside to start the controller afresh (the trainer's checkpoints and "
            "lineage.jsonl stay)"
        )
        notices.post(self.run_dir, "fatal", message, source="controller")
        raise NoIntactSnapshotError(message)

    def read_latest(self) -> Snapshot | None:
        """The snapshot ``LATEST`` names, read only (nothing set aside or committed, unlike
        ``load_latest``): for a reader beside a live controller, which may have moved on and
        pruned what it read; None when there is none or it does not verify as read."""
        data, _ = storage.read_versioned(self.pointer)
        if data is None:
            return None
        try:
            pointer = json.loads(data)
            return self._load_file(str(pointer["file"]), str(pointer["sha256"]))
        except (_Damaged, SnapshotError, ValueError, UnicodeDecodeError, KeyError, TypeError):
            return None

    def _rel(self, path: str) -> str:
        """``path`` relative to the run directory (for notices)."""
        root = self.run_dir.rstrip("/") + "/"
        return path[len(root) :] if path.startswith(root) else path

    def _candidates(self, below: tuple[int, int] | None) -> list[str]:
        """Snapshot file names older than ``below`` (all of them for None), newest first."""
        named = [(_order(n), n) for n in storage.list_children(self.dir)]
        older = [(o, n) for o, n in named if o is not None and (below is None or o < below)]
        return [n for _, n in sorted(older, reverse=True)]

    def _load_file(self, name: str, sha: str | None) -> Snapshot:
        """The snapshot in file ``name``; ``_Damaged`` when it does not verify (against
        ``sha``, the pointer's, when given; against its own otherwise)."""
        path = storage.join(self.dir, name)
        try:
            payload = storage.read_bytes(path)
        except FileNotFoundError:
            raise _Damaged("does not exist") from None
        if sha is not None and _sha256(payload) != sha:
            raise _Damaged(f"does not match the sha256 in {self._rel(self.pointer)}")
        try:
            body = json.loads(payload)
        except (ValueError, UnicodeDecodeError) as e:
            raise _Damaged(f"is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise _Damaged("does not hold a JSON object")
        own = body.pop("sha256", None)
        if own is not None and own != _body_sha256(body):
            raise _Damaged("does not match its own sha256")
        if "format" not in body:
            raise _Damaged("has no format")
        if body.pop("format") != SNAPSHOT_FORMAT:
            raise SnapshotError(f"{path}: unknown snapshot format (written by another version?)")
        missing = [k for k in (*_REQUIRED, "buffer_file") if k not in body]
        if missing:
            raise _Damaged(f"has no {', '.join(missing)}")
        try:
            body["buffer"]["groups"] = self._sidecar(body.pop("buffer_file"))
            body["partials"] = self._sidecar(body.pop("partials_file", None))
            return Snapshot(**body)
        except (KeyError, TypeError, ValueError, OSError) as e:  # (OSError: a bad parquet)
            if isinstance(e, _Damaged):
                raise
            raise _Damaged(f"does not hold a snapshot ({type(e).__name__}: {e})") from None

    def _sidecar(self, sidecar: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The rows of a Parquet file a snapshot names (none for None); ``_Damaged`` when it
        is missing or does not match its sha256."""
        if sidecar is None:
            return []
        try:
            data = storage.read_bytes(storage.join(self.dir, sidecar["name"]))
        except FileNotFoundError:
            raise _Damaged(f"names {sidecar['name']}, which does not exist") from None
        if _sha256(data) != sidecar["sha256"]:
            raise _Damaged(f"names {sidecar['name']}, which does not match its sha256")
        return _groups_from_parquet(data)

    def _set_aside_snapshot(self, name: str) -> str:
        """Sets aside snapshot file ``name`` and its Parquet files; the notice's wording."""
        said = self._set_aside(storage.join(self.dir, name))
        stem = name[: -len(".json")]
        for kind in ("buffer", "partials"):
            sidecar = storage.join(self.dir, f"{stem}.{kind}.parquet")
            if storage.exists(sidecar):
                self._set_aside(sidecar)
        return said

    def _set_aside(self, path: str, copy: bool = False) -> str:
        """Renames ``path`` to ``<path>.damaged-<time>`` (``copy``: keeps ``path``, which is
        about to be replaced); returns the notice's wording ("" when there was nothing)."""
        target = f"{path}{DAMAGED_TAG}{time.strftime('%Y%m%dT%H%M%S')}"
        n = 1
        while storage.exists(target):
            n += 1
            target = f"{path}{DAMAGED_TAG}{time.strftime('%Y%m%dT%H%M%S')}-{n}"
        try:
            if storage.is_gcs(path) or copy:
                storage.write_bytes(target, storage.read_bytes(path))
                if not copy:
                    storage.delete_prefix(path)
            else:
                os.replace(path, target)
        except FileNotFoundError:
            return ""
        log.warning("%s set aside as %s", path, target)
        return f": set aside as {self._rel(target)}"

    def _commit(self, name: str) -> None:
        """Points ``LATEST`` at snapshot file ``name`` (after a fallback)."""
        payload = storage.read_bytes(storage.join(self.dir, name))
        step = _order(name)[0]  # type: ignore[index]
        pointer = {"step": step, "file": name, "sha256": _sha256(payload)}
        self._generation = storage.commit_pointer(
            self.pointer, json.dumps(pointer).encode(), if_generation_match=self._generation
        )

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
            for suffix in (f"{pending}{kind}" for pending in ("", ".pending") for kind in _FILES):
                path = storage.join(self.dir, f"{step}{suffix}")
                if storage.exists(path):
                    storage.delete_prefix(path)
