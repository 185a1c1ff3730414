"""Orbax checkpoints of the trainer: <dir>/<step>/{state, meta}, written async, restored only
when intact. Complete = finalized by Orbax, with its commit metadata, both items' metadata and
every file of ``rlax_manifest.json`` at its recorded size; a finalized one that does not verify
is set aside as ``<step>.damaged-<time>`` (never deleted) and the newest older one is used. A
save that cannot be written is counted, not raised (``MAX_FAILED_CHECKPOINTS``: trainer stops)."""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import time
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint.path import step as step_lib

from rlax_tasks.rundir import storage

log = logging.getLogger(__name__)

STATE_ITEM = "state"
META_ITEM = "meta"
ORBAX_METADATA_FILE = "_CHECKPOINT_METADATA"
# what Orbax appends to a step directory's name while writing it (renamed away when it commits)
ORBAX_TMP_SUFFIX = ".orbax-checkpoint-tmp"
# files each item's handler writes when it finishes
ITEM_METADATA_FILES = {STATE_ITEM: "_METADATA", META_ITEM: "metadata"}
MANIFEST_FILE = "rlax_manifest.json"  # {"format", "step", "files": {relative path: bytes}}
MANIFEST_FORMAT = 1
DAMAGED_TAG = ".damaged-"  # a damaged checkpoint is renamed <step>.damaged-<time>
# checkpoints in a row that could not be written before the trainer stops (each retried at the
# next trainer.checkpoint_every): a few intervals of a transient outage, not a whole run
# without checkpoints
MAX_FAILED_CHECKPOINTS = 3
# TensorStore's status codes for data that is not there or not what it should be (a missing or
# truncated file): a restore failing with one of them means a damaged checkpoint, where any
# other error (a shape that does not match the model, say) is the caller's to see
_DATA_DAMAGE = re.compile(r"\b(NOT_FOUND|OUT_OF_RANGE|DATA_LOSS)\b")
# TensorStore's codes for a write that the storage refused (ENOSPC arrives as one of them)
_WRITE_STATUS = re.compile(
    r"^(OUT_OF_RANGE|RESOURCE_EXHAUSTED|PERMISSION_DENIED|UNAVAILABLE|DATA_LOSS|INTERNAL|"
    r"UNKNOWN|ABORTED|DEADLINE_EXCEEDED|NOT_FOUND|FAILED_PRECONDITION):"
)
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


@dataclasses.dataclass(frozen=True)
class SetAside:
    """A damaged checkpoint that was renamed out of the way."""

    step: int
    path: str  # its new name
    reason: str


@dataclasses.dataclass(frozen=True)
class WriteFailure:
    """A checkpoint that could not be written."""

    step: int
    path: str
    error: str  # the OS error, e.g. "No space left on device (ENOSPC)"


def _manifest(step_dir: epath.Path) -> dict[str, int]:
    """{path relative to ``step_dir``: size} of every file under the step's item directories."""
    root = str(step_dir).rstrip("/") + "/"
    out = {}
    for info in storage.list_objects(str(step_dir)):
        rel = info.path[len(root) :] if info.path.startswith(root) else info.path
        if "/" in rel:  # an item's file (top-level files are Orbax's commit records)
            out[rel] = info.size
    return out


def checkpoint_problem(step_dir: epath.PathLike) -> str | None:
    """Why ``step_dir`` is not a complete, intact checkpoint; None when it is."""
    step_dir = epath.Path(step_dir)
    try:
        if not step_dir.is_dir():
            return "is not a directory"
        if not step_lib.is_path_finalized(step_dir):
            return "was never finalized (an interrupted save)"
        meta_file = step_dir / ORBAX_METADATA_FILE
        if not meta_file.exists():
            return f"has no {ORBAX_METADATA_FILE}"
        if json.loads(meta_file.read_text()).get("commit_timestamp_nsecs") is None:
            return f"{ORBAX_METADATA_FILE} has no commit timestamp"
        for item, name in ITEM_METADATA_FILES.items():
            if not (step_dir / item / name).exists():
                return f"has no {item}/{name}"
        manifest_file = step_dir / MANIFEST_FILE
        if not manifest_file.exists():
            return None  # written before manifests: checked by reading it (restore_latest)
        want = json.loads(manifest_file.read_text())["files"]
        have = _manifest(step_dir)
        for rel, size in sorted(want.items()):
            if rel not in have:
                return f"{rel} is missing"
            if have[rel] != size:
                return f"{rel} has {have[rel]} bytes, its manifest says {size}"
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:  # unreadable / truncated metadata
        return f"is unreadable ({e})"


def is_complete_checkpoint(step_dir: epath.PathLike) -> bool:
    """Whether ``step_dir`` is a finished, intact checkpoint (see the module docstring)."""
    problem = checkpoint_problem(step_dir)
    if problem is not None:
        log.debug("checkpoint %s %s", step_dir, problem)
    return problem is None


def describe_error(error: BaseException) -> str:
    """A storage error in a line: the OS error with its errno name when there is one
    ("No space left on device (ENOSPC)"), else the error's own first line."""
    code = getattr(error, "errno", None)
    if code is None:
        found = _OS_ERROR_CODE.search(str(error))
        code = int(found.group(1)) if found else None
    if code:
        return f"{os.strerror(code)} ({errno.errorcode.get(code, code)})"
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:300]


def is_write_error(error: BaseException) -> bool:
    """Whether ``error`` is the storage refusing a write (OSError, or TensorStore's status)."""
    if isinstance(error, OSError):
        return True
    text = str(error)
    return isinstance(error, ValueError | RuntimeError) and bool(
        _WRITE_STATUS.match(text) or _OS_ERROR_CODE.search(text)
    )


def is_data_damage(error: BaseException) -> bool:
    """Whether a restore failed because the checkpoint's data is missing or corrupt."""
    if isinstance(error, FileNotFoundError):
        return True
    return isinstance(error, ValueError | RuntimeError | OSError) and bool(
        _DATA_DAMAGE.search(str(error))
    )


def _move(path: epath.Path, target: epath.Path) -> None:
    """Renames a checkpoint directory; on GCS, copies every object server-side (in-bucket
    rewrites: no bytes through this host), then removes the originals."""
    if not storage.is_gcs(str(path)):
        path.rename(target)
        return
    src, dst = str(path).rstrip("/") + "/", str(target).rstrip("/") + "/"
    bucket_name, _ = storage._split_gcs(src)  # (storage has no copy: its client, in-bucket)
    bucket = storage._client().bucket(bucket_name)
    objects = storage.list_prefix(src)
    for obj in objects:
        blob = bucket.blob(storage._split_gcs(obj)[1])
        bucket.copy_blob(blob, bucket, storage._split_gcs(dst + obj[len(src) :])[1])
    for obj in objects:
        bucket.blob(storage._split_gcs(obj)[1]).delete()


class Checkpointer:
    """Saves and restores trainer checkpoints under ``directory`` (local path or gs:// URI)."""

    def __init__(
        self, directory: str, max_to_keep: int | None = 3, async_save: bool = True
    ) -> None:
        if storage.is_gcs(str(directory)):
            storage.configure_gcs_clients()  # gcsfs and TensorStore: same endpoint as storage
        # Orbax writes through TensorStore, which refuses relative paths (a relative run_root)
        local = not storage.is_gcs(str(directory))
        self.directory = epath.Path(directory if not local else os.path.abspath(directory))
        self.async_save = async_save
        self.set_aside: list[SetAside] = []  # damaged checkpoints renamed by this checkpointer
        self.failures = 0  # checkpoints in a row that could not be written
        self.last_failure: WriteFailure | None = None
        self.last_good_step: int | None = None  # the newest step known committed and intact
        self._pending: int | None = None  # the step of the save under way
        if jax.process_index() == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._clean()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
            # the manifest joins the checkpoint before Orbax commits it (primary host only)
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest)
            if async_save
            else None,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self.last_good_step = self.latest_step()

    # ------------------------------------------------------------------ listing
    def _entries(self) -> list[epath.Path]:
        """The directory's entries ([] when it has none: on GCS an empty prefix does not exist,
        even right after ``mkdir``)."""
        try:
            return list(self.directory.iterdir())
        except FileNotFoundError:
            return []

    def _step_dirs(self) -> dict[int, epath.Path]:
        """Step number -> directory, for every entry named by an integer (complete or not)."""
        return {int(p.name): p for p in self._entries() if p.name.isdigit()}

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint, ascending."""
        return sorted(s for s, p in self._step_dirs().items() if is_complete_checkpoint(p))

    def latest_step(self) -> int | None:
        """The newest complete step, or None."""
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def _clean(self) -> None:
        """Removes what interrupted saves left (step directories never finalized, Orbax's
        temporary ones: Orbax's own clean-up of the latter runs on a background thread, so a
        directory listed right after opening could still show them) and sets damaged
        checkpoints aside."""
        for step, path in sorted(self._step_dirs().items()):
            problem = checkpoint_problem(path)
            if problem is None:
                continue
            if step_lib.is_path_finalized(path):
                self._set_aside(step, problem)
            else:
                log.warning("removing incomplete checkpoint %s (left by an interrupted save)", path)
                path.rmtree()
        for path in self._entries():
            if ORBAX_TMP_SUFFIX in path.name and path.is_dir():
                log.warning("removing %s (left by an interrupted save)", path)
                path.rmtree()

    def _set_aside(self, step: int, reason: str) -> SetAside:
        """Renames the checkpoint of ``step`` to ``<step>.damaged-<time>`` (never deletes it)."""
        path = self.directory / str(step)
        stamp = time.strftime("%Y%m%dT%H%M%S")
        target = self.directory / f"{step}{DAMAGED_TAG}{stamp}"
        n = 1
        while target.exists():
            n += 1
            target = self.directory / f"{step}{DAMAGED_TAG}{stamp}-{n}"
        _move(path, target)
        log.warning("checkpoint %s %s: set aside as %s", path, reason, target)
        entry = SetAside(step, str(target), reason)
        self.set_aside.append(entry)
        return entry

    # ------------------------------------------------------------------ save / restore
    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Starts saving ``state`` (array pytree) and ``meta`` (JSON dict) as ``step``.

        Returns once the arrays are copied off the devices (async mode); the write continues in
        the background. The previous save is waited for first. A save the storage refuses is
        counted in ``failures`` (``last_failure`` says why), not raised."""
        json.dumps(meta)  # fail here, not in a background thread, on non-JSON data
        self._settle()
        self._pending = step
        try:
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{
                        STATE_ITEM: ocp.args.StandardSave(state),
                        META_ITEM: ocp.args.JsonSave(meta),
                    }
                ),
                force=True,
            )
        except Exception as e:  # noqa: BLE001 - only write errors are counted, see below
            if not is_write_error(e):
                self._pending = None
                raise
            self._failed(step, e)
            return
        if not saved:
            self._pending = None
            raise RuntimeError(f"orbax did not save step {step} under {self.directory}")
        log.info("checkpoint of step %d started under %s", step, self.directory)
        if not self.async_save:
            if jax.process_index() == 0:
                self._write_manifest()
            self._settle()

    def _write_manifest(self) -> None:
        """Records the size of every file of the step being saved (Orbax's post-finalization
        callback: every host finished writing, the directory is not committed yet)."""
        step = self._pending
        if step is None:
            return
        step_dir = self.directory / str(step)
        for path in self._entries():  # a local save is still in its temporary directory
            if path.name.startswith(f"{step}{ORBAX_TMP_SUFFIX}"):
                step_dir = path
        manifest = {"format": MANIFEST_FORMAT, "step": step, "files": _manifest(step_dir)}
        storage.write_bytes(str(step_dir / MANIFEST_FILE), json.dumps(manifest).encode())

    def _settle(self) -> None:
        """Waits for the save under way; records whether it committed intact."""
        step = self._pending
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the background write failed: counted
            if step is None:
                if not is_write_error(e):
                    raise
                log.warning("checkpoints under %s: %s", self.directory, e)
                return
            self._failed(step, e)
            return
        if step is None:
            return
        self._pending = None
        problem = checkpoint_problem(self.directory / str(step))
        if problem is not None:
            self._failed(step, RuntimeError(f"checkpoint {step} {problem} after its save"))
            return
        self.failures, self.last_failure, self.last_good_step = 0, None, step

    def _failed(self, step: int, error: BaseException) -> None:
        self._pending = None
        self.failures += 1
        path = str(self.directory / str(step))
        self.last_failure = WriteFailure(step, path, describe_error(error))
        log.warning(
            "checkpoint of step %d could not be written to %s (%d in a row): %s",
            step, path, self.failures, error,
        )  # fmt: skip

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """(state, meta) of ``step``; ``abstract_state`` gives shapes, dtypes and shardings."""
        path = self.directory / str(step)
        if not is_complete_checkpoint(path):
            raise FileNotFoundError(f"no complete checkpoint of step {step} under {self.directory}")
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                **{
                    STATE_ITEM: ocp.args.StandardRestore(abstract_state),
                    META_ITEM: ocp.args.JsonRestore(),
                }
            ),
        )
        return out[STATE_ITEM], dict(out[META_ITEM])

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict[str, Any]] | None:
        """(step, state, meta) of the newest intact checkpoint, or None when there is none.

        A checkpoint whose arrays cannot be read (a file missing or cut short) is set aside and
        the next older one tried (one process only: on a multi-host trainer the hosts could not
        agree on which to skip, so the error is raised with the checkpoint's name)."""
        self.wait()
        for step in reversed(self.complete_steps()):
            try:
                state, meta = self.restore(step, abstract_state)
            except Exception as e:  # noqa: BLE001 - only damaged data falls back, see below
                if not is_data_damage(e):
                    raise
                reason = f"cannot be read ({describe_error(e)})"
                if jax.process_count() > 1:
                    raise RuntimeError(
                        f"checkpoint {self.directory / str(step)} {reason}: move it out of "
                        f"{self.directory} and start again to resume from the one before"
                    ) from e
                self._set_aside(step, reason)
                self._manager.reload()  # forget the step it listed
                continue
            self.last_good_step = step
            return step, state, meta
        return None

    def wait(self) -> None:
        """Blocks until the background save (if any) has been committed (or has failed:
        ``failures`` counts it)."""
        self._settle()

    def close(self) -> None:
        """Waits for pending saves and releases Orbax's resources."""
        self._settle()
        self._manager.close()
