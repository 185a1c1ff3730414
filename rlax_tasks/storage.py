"""One object-store abstraction for the whole project: a local directory or ``gs://bucket/prefix``.

Every component that writes durable state (the parameter-server mirror, checkpoints, controller
snapshots, reports) goes through these functions, so the same code runs on a laptop (local disk)
and on Cloud TPU (GCS). GCS goes through the real ``google-cloud-storage`` client; setting
``STORAGE_EMULATOR_HOST`` (e.g. ``http://127.0.0.1:9023``) points it at a local emulator with
anonymous credentials, which is how the tests run it.

Paths are strings; ``join`` builds them. Objects are flat byte strings; "directories" are prefixes.
``commit_pointer`` is the one atomic compare-and-swap write (write temp + ``os.replace`` locally, a
generation precondition on GCS): snapshots and mirrors publish through it or through a marker
object written last.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import BinaryIO

log = logging.getLogger(__name__)

GCS_SCHEME = "gs://"
# streaming upload/download granularity on GCS (a multiple of 256 KiB, as the API requires)
GCS_CHUNK_BYTES = 16 * 1024 * 1024


class PreconditionFailedError(RuntimeError):
    """An atomic pointer write lost a race: the object changed since the caller read it."""


def is_gcs(path: str) -> bool:
    """Whether ``path`` is a ``gs://bucket/...`` URI (else a local filesystem path)."""
    return path.startswith(GCS_SCHEME)


def join(base: str, *parts: str) -> str:
    """``base/part1/part2`` for local paths and gs:// URIs alike (no duplicate slashes)."""
    out = base.rstrip("/") if base not in ("/", GCS_SCHEME) else base
    for part in parts:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}" if not out.endswith("/") else out + part
    return out


def _split_gcs(path: str) -> tuple[str, str]:
    """("bucket", "key/inside") of a gs:// URI."""
    rest = path[len(GCS_SCHEME) :]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise ValueError(f"storage path {path!r} names no bucket: use gs://BUCKET/PREFIX")
    return bucket, key


@functools.cache
def _client():  # noqa: ANN202 - google.cloud.storage.Client, imported lazily
    """The process-wide GCS client (honours STORAGE_EMULATOR_HOST; anonymous on the emulator)."""
    from google.cloud import storage as gcs

    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        project = os.environ.get("GOOGLE_CLOUD_PROJECT", "rlax-local")
        return gcs.Client(project=project, credentials=AnonymousCredentials())
    return gcs.Client()


def _blob(path: str):  # noqa: ANN202 - google.cloud.storage.Blob
    bucket, key = _split_gcs(path)
    if not key:
        raise ValueError(f"storage path {path!r} names a bucket, not an object")
    return _client().bucket(bucket).blob(key)


# --------------------------------------------------------------------------- whole objects
def read_bytes(path: str) -> bytes:
    """The content of one object; FileNotFoundError when it does not exist."""
    if is_gcs(path):
        from google.api_core.exceptions import NotFound

        try:
            return _blob(path).download_as_bytes()
        except NotFound as e:
            raise FileNotFoundError(f"no object at {path}") from e
    with open(path, "rb") as fh:
        return fh.read()


def write_bytes(path: str, data: bytes) -> None:
    """Writes one object whole; readers never see a partial object (temp + rename locally)."""
    if is_gcs(path):
        _blob(path).upload_from_string(data, content_type="application/octet-stream")
        return
    with open_write(path) as fh:
        fh.write(data)


def exists(path: str) -> bool:
    """Whether an object exists at ``path`` (for local paths: a file or a directory)."""
    if is_gcs(path):
        return _blob(path).exists()
    return os.path.exists(path)


def list_prefix(prefix: str) -> list[str]:
    """Full paths of every object under ``prefix`` (recursive), sorted."""
    if is_gcs(prefix):
        bucket, key = _split_gcs(prefix)
        key = key.rstrip("/") + "/" if key else ""
        return sorted(
            f"{GCS_SCHEME}{bucket}/{b.name}" for b in _client().list_blobs(bucket, prefix=key)
        )
    if not os.path.isdir(prefix):
        return []
    out = []
    for root, _dirs, files in os.walk(prefix):
        out.extend(os.path.join(root, f) for f in files)
    return sorted(out)


def list_children(prefix: str) -> list[str]:
    """Names (not paths) of the immediate children of ``prefix``: objects and sub-prefixes."""
    if is_gcs(prefix):
        bucket, key = _split_gcs(prefix)
        key = key.rstrip("/") + "/" if key else ""
        it = _client().list_blobs(bucket, prefix=key, delimiter="/")
        names = {b.name[len(key) :] for b in it}
        names |= {p[len(key) :].rstrip("/") for p in it.prefixes}
        return sorted(n for n in names if n)
    if not os.path.isdir(prefix):
        return []
    return sorted(os.listdir(prefix))


def delete_prefix(prefix: str) -> None:
    """Deletes ``prefix`` and everything under it (no error when nothing is there)."""
    if is_gcs(prefix):
        bucket, key = _split_gcs(prefix)
        if not key:
            raise ValueError(f"refusing to delete a whole bucket ({prefix})")
        blobs = list(_client().list_blobs(bucket, prefix=key.rstrip("/") + "/"))
        single = _client().bucket(bucket).blob(key)
        if single.exists():
            blobs.append(single)
        for blob in blobs:
            blob.delete()
        return
    if os.path.isdir(prefix):
        shutil.rmtree(prefix, ignore_errors=True)
    elif os.path.exists(prefix):
        os.remove(prefix)


# --------------------------------------------------------------------------- streaming
@contextlib.contextmanager
def open_write(path: str) -> Iterator[BinaryIO]:
    """A binary file to stream an object into; it appears at ``path`` only on a clean exit.

    Locally: a temp file in the same directory, renamed on success (removed on error). On GCS: a
    resumable upload finalised on close (an exception aborts it, so no object is created).
    """
    if is_gcs(path):
        writer = _blob(path).open("wb", chunk_size=GCS_CHUNK_BYTES, ignore_flush=True)
        try:
            yield writer
        except BaseException:
            # cancel the resumable session: closing (even by the garbage collector) would
            # finalise it and publish a partial object
            try:
                writer.terminate()
            except Exception:  # noqa: BLE001 - the session expires server-side anyway
                log.warning("could not cancel the upload of %s", path, exc_info=True)
                writer._buffer.close()  # no public way to drop the buffer without uploading
            raise
        writer.close()
        return
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=".tmp-", suffix="-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


@contextlib.contextmanager
def open_read(path: str) -> Iterator[BinaryIO]:
    """A binary file streaming an object (ranged reads on GCS); FileNotFoundError if missing."""
    if is_gcs(path):
        blob = _blob(path)
        if not blob.exists():
            raise FileNotFoundError(f"no object at {path}")
        with blob.open("rb", chunk_size=GCS_CHUNK_BYTES) as reader:
            yield reader
        return
    with open(path, "rb") as fh:
        yield fh


def read_into(fh: BinaryIO, out: memoryview) -> None:
    """Fills ``out`` from a stream (``readinto`` where the stream has it); EOFError if it ends."""
    got, n = 0, len(out)
    readinto = getattr(fh, "readinto", None)
    while got < n:
        if readinto is not None:
            k = readinto(out[got:])
        else:
            data = fh.read(n - got)
            k = len(data)
            out[got : got + k] = data
        if not k:
            raise EOFError(f"stream ended after {got} of {n} bytes")
        got += k


# --------------------------------------------------------------------------- atomic pointers
def read_versioned(path: str) -> tuple[bytes | None, int]:
    """(content, generation) of a pointer object; (None, 0) when it does not exist."""
    if is_gcs(path):
        from google.api_core.exceptions import NotFound, PreconditionFailed

        blob = _blob(path)
        for _ in range(8):  # content and generation must belong together
            try:
                blob.reload()
                generation = int(blob.generation or 0)
                return blob.download_as_bytes(if_generation_match=generation), generation
            except NotFound:
                if not blob.exists():
                    return None, 0
            except PreconditionFailed:
                pass  # replaced between the two requests: read again
        raise PreconditionFailedError(f"{path} keeps changing while being read")
    try:
        with open(path, "rb") as fh:
            data = fh.read()
            return data, _local_generation(os.fstat(fh.fileno()))
    except FileNotFoundError:
        return None, 0


def commit_pointer(path: str, data: bytes, if_generation_match: int | None = None) -> int:
    """Atomically replaces a small pointer object; returns its new generation.

    With ``if_generation_match`` (0 = "must not exist yet", else the generation ``read_versioned``
    returned) the write happens only if nobody changed the object since; otherwise
    PreconditionFailedError. GCS enforces this server-side (``if_generation_match``); locally a
    lock file serialises writers and the generation is derived from the file's inode and mtime.
    """
    if is_gcs(path):
        from google.api_core.exceptions import PreconditionFailed

        blob = _blob(path)
        try:
            blob.upload_from_string(data, if_generation_match=if_generation_match)
        except PreconditionFailed as e:
            raise PreconditionFailedError(
                f"{path} changed since generation {if_generation_match}"
            ) from e
        return int(blob.generation or 0)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path + ".lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if if_generation_match is not None:
                _, current = read_versioned(path)
                if current != if_generation_match:
                    raise PreconditionFailedError(
                        f"{path} is at generation {current}, expected {if_generation_match}"
                    )
            with open_write(path) as fh:
                fh.write(data)
            return _local_generation(os.stat(path))
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _local_generation(st: os.stat_result) -> int:
    """A generation number for a local file: changes on every replace (new inode, new mtime)."""
    return (st.st_ino << 64) | st.st_mtime_ns


def copy_stream(src: BinaryIO, dst: BinaryIO, chunk_bytes: int = 8 * 1024 * 1024) -> int:
    """Copies a stream in bounded chunks; returns the bytes copied."""
    buf = bytearray(chunk_bytes)
    view = memoryview(buf)
    total = 0
    while True:
        k = src.readinto(view) if hasattr(src, "readinto") else _read_to(src, view)
        if not k:
            return total
        dst.write(view[:k])
        total += k


def _read_to(src: BinaryIO, view: memoryview) -> int:
    data = src.read(len(view))
    view[: len(data)] = data
    return len(data)


__all__ = [
    "PreconditionFailedError",
    "commit_pointer",
    "copy_stream",
    "delete_prefix",
    "exists",
    "is_gcs",
    "join",
    "list_children",
    "list_prefix",
    "open_read",
    "open_write",
    "read_bytes",
    "read_into",
    "read_versioned",
    "write_bytes",
]
