"""One object store for the whole project: a local directory or ``gs://bucket/prefix``.

Every component that writes durable state goes through it, so the same code runs on a laptop
and on Cloud TPU; ``STORAGE_EMULATOR_HOST`` points GCS at an emulator (the tests). Paths are
strings (``join``); ``commit_pointer`` is the one atomic compare-and-swap write."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any, BinaryIO

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
    from google.cloud import storage as gcs  # lazy: gs:// paths only

    configure_gcs_clients()
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials  # lazy: gs:// paths only

        project = os.environ.get("GOOGLE_CLOUD_PROJECT", "rlax-local")
        return gcs.Client(project=project, credentials=AnonymousCredentials())
    return gcs.Client()


def _blob(path: str):  # noqa: ANN202 - google.cloud.storage.Blob
    bucket, key = _split_gcs(path)
    if not key:
        raise ValueError(f"storage path {path!r} names a bucket, not an object")
    return _client().bucket(bucket).blob(key)


# TensorStore's GCS endpoint and test token (read when a kvstore opens)
TENSORSTORE_GCS_URL_ENV = "TENSORSTORE_GCS_HTTP_URL"
TENSORSTORE_TOKEN_ENV = "GOOGLE_AUTH_TOKEN_FOR_TESTING"
_configure_lock = threading.Lock()
_set_by_us: dict[str, str] = {}  # environment variables configure_gcs_clients set, and to what


def configure_gcs_clients() -> None:
    """Points the GCS clients Orbax uses (gcsfs, TensorStore) at this module's endpoint; idempotent.

    gcsfs lists without its directory cache (others write checkpoints behind its back); with
    ``STORAGE_EMULATOR_HOST`` both go to the emulator anonymously. A variable the user set is kept.
    Call it before Orbax touches the first gs:// path: etils caches its gcsfs per process."""
    with _configure_lock:
        host = os.environ.get("STORAGE_EMULATOR_HOST") or None
        if host and "://" not in host:
            host = f"http://{host}"
        token = "emulator" if host else None
        wanted = {TENSORSTORE_GCS_URL_ENV: host, TENSORSTORE_TOKEN_ENV: token}
        for name, value in wanted.items():
            if name in os.environ and _set_by_us.get(name) != os.environ[name]:
                continue  # the user's own setting
            if value is None:
                if _set_by_us.pop(name, None) is not None:
                    os.environ.pop(name, None)
            else:
                os.environ[name] = _set_by_us[name] = value
        _configure_fsspec(emulated=host is not None)


def _configure_fsspec(emulated: bool) -> None:
    try:
        import fsspec  # lazy: only Orbax on gs:// needs it
        import fsspec.config
    except ImportError:  # no gcsfs/fsspec installed: Orbax cannot reach gs:// anyway
        return
    for protocol in ("gs", "gcs"):
        options = fsspec.config.conf.setdefault(protocol, {})
        options["use_listings_cache"] = False
        if emulated and protocol not in _fsspec_before_emulator:
            try:
                default = fsspec.get_filesystem_class(protocol)
                # the plain class: its default subclass needs an API emulators lack
                from gcsfs.core import GCSFileSystem
            except ImportError:
                continue
            _fsspec_before_emulator[protocol] = (default, options.get("token"))
            fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)
            options["token"] = "anon"
        elif not emulated and protocol in _fsspec_before_emulator:
            default, token = _fsspec_before_emulator.pop(protocol)
            fsspec.register_implementation(protocol, default, clobber=True)
            if token is None:
                options.pop("token", None)
            else:
                options["token"] = token


# protocol -> (filesystem class, token option) before the emulator was configured
_fsspec_before_emulator: dict[str, tuple[type, str | None]] = {}


# --------------------------------------------------------------------------- whole objects
def read_bytes(path: str) -> bytes:
    """The content of one object; FileNotFoundError when it does not exist."""
    if is_gcs(path):
        from google.api_core.exceptions import NotFound  # lazy: gs:// paths only

        try:
            return _blob(path).download_as_bytes()
        except NotFound as e:
            raise FileNotFoundError(f"no object at {path}") from e
    with open(path, "rb") as fh:
        return fh.read()


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file or gs:// object, in order; a line cut by a crash (or not
    an object) is skipped; [] when it does not exist."""
    try:
        text = read_bytes(path).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut by a crash
        if isinstance(row, dict):
            rows.append(row)
    return rows


def write_bytes(path: str, data: bytes) -> None:
    """Writes one object whole; readers never see a partial object (temp + rename locally)."""
    if is_gcs(path):
        _blob(path).upload_from_string(data, content_type="application/octet-stream")
        return
    with open_write(path) as fh:
        fh.write(data)


def append_line(path: str, line: bytes) -> None:
    """Adds ``line`` at the end of a local file (its directory made), or of a gs:// object,
    which cannot be appended to: rewritten whole (for small files with one writer)."""
    if is_gcs(path):
        try:
            before = read_bytes(path)
        except FileNotFoundError:
            before = b""
        write_bytes(path, before + line)
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "ab") as fh:
        fh.write(line)


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


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One object's metadata. ``generation`` changes whenever the object is replaced; ``crc32c``
    and ``md5`` are GCS's base64 checksums (None locally, and ``md5`` on composite objects)."""

    path: str
    size: int
    generation: int
    updated: float | None = None  # unix seconds of the last change
    crc32c: str | None = None
    md5: str | None = None

    @property
    def name(self) -> str:
        """The last component of the path."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]


def _info_of_blob(bucket: str, blob) -> ObjectInfo:  # noqa: ANN001 - google.cloud.storage.Blob
    return ObjectInfo(
        path=f"{GCS_SCHEME}{bucket}/{blob.name}",
        size=int(blob.size or 0),
        generation=int(blob.generation or 0),
        updated=blob.updated.timestamp() if blob.updated else None,
        crc32c=blob.crc32c,
        md5=blob.md5_hash,
    )


def _info_of_file(path: str) -> ObjectInfo:
    st = os.stat(path)
    return ObjectInfo(path, st.st_size, _local_generation(st), st.st_mtime)


def stat(path: str) -> ObjectInfo | None:
    """The metadata of the object at ``path``; None when there is none (or it is a directory)."""
    if is_gcs(path):
        from google.api_core.exceptions import NotFound  # lazy: gs:// paths only

        bucket, _ = _split_gcs(path)
        blob = _blob(path)
        try:
            blob.reload()
        except NotFound:
            return None
        return _info_of_blob(bucket, blob)
    try:
        return _info_of_file(path) if os.path.isfile(path) else None
    except FileNotFoundError:
        return None


def list_objects(prefix: str, recursive: bool = True) -> list[ObjectInfo]:
    """Metadata of the objects under ``prefix`` (only its immediate objects when not
    ``recursive``), sorted by path; one listing request per page on GCS."""
    if is_gcs(prefix):
        bucket, key = _split_gcs(prefix)
        key = key.rstrip("/") + "/" if key else ""
        blobs = _client().list_blobs(bucket, prefix=key, delimiter=None if recursive else "/")
        out = [_info_of_blob(bucket, b) for b in blobs if not b.name.endswith("/")]
        return sorted(out, key=lambda o: o.path)
    if not os.path.isdir(prefix):
        return []
    if recursive:
        return [_info_of_file(p) for p in list_prefix(prefix)]
    names = sorted(os.listdir(prefix))
    return [_info_of_file(p) for p in (os.path.join(prefix, n) for n in names) if os.path.isfile(p)]


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


def download_range(
    path: str, out: BinaryIO, start: int, end: int, generation: int | None = None
) -> None:
    """Writes bytes ``[start, end)`` of an object into the stream ``out``, as stored (no
    decompression). With ``generation``, only from that generation: PreconditionFailedError when
    the object was replaced since (GCS checks it server-side). A ranged read carries no checksum:
    callers verify the whole object (``ObjectInfo.crc32c``) once all ranges are in."""
    if end <= start:
        return
    if is_gcs(path):
        # lazy: gs:// paths only
        from google.api_core.exceptions import NotFound, PreconditionFailed

        try:
            _blob(path).download_to_file(
                out,
                start=start,
                end=end - 1,  # inclusive on the API
                raw_download=True,
                if_generation_match=generation,
                checksum=None,
            )
        except NotFound as e:
            raise FileNotFoundError(f"no object at {path}") from e
        except PreconditionFailed as e:
            raise PreconditionFailedError(f"{path} changed since generation {generation}") from e
        return
    with open(path, "rb") as fh:
        if generation is not None and _local_generation(os.fstat(fh.fileno())) != generation:
            raise PreconditionFailedError(f"{path} changed since generation {generation}")
        fh.seek(start)
        left = end - start
        while left:
            data = fh.read(min(left, 8 * 1024 * 1024))
            if not data:
                raise EOFError(f"{path} ends before byte {end}")
            out.write(data)
            left -= len(data)


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
        # lazy: gs:// paths only
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

    With ``if_generation_match`` (0: must not exist yet; else what ``read_versioned`` returned)
    the write happens only if nobody changed the object since, else PreconditionFailedError
    (server-side on GCS; locally a lock file serialises writers)."""
    if is_gcs(path):
        from google.api_core.exceptions import PreconditionFailed  # lazy: gs:// paths only

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
    "ObjectInfo",
    "PreconditionFailedError",
    "commit_pointer",
    "configure_gcs_clients",
    "copy_stream",
    "delete_prefix",
    "download_range",
    "exists",
    "is_gcs",
    "join",
    "list_children",
    "list_objects",
    "list_prefix",
    "open_read",
    "open_write",
    "read_bytes",
    "read_into",
    "read_versioned",
    "stat",
    "write_bytes",
]
