"""Local copies of HF model directories on GCS (``model.path: gs://...``), in ``$RLAX_MODEL_CACHE``.

Only the files a model needs are fetched, by ranges on parallel threads; each is checksummed
(CRC32C, else MD5) before its rename, recorded with its generation in ``.rlax-model-cache.json``
so a later call fetches only what changed, under one ``fcntl`` lock per directory per host."""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator

import google_crc32c

from rlax_tasks.rundir import storage
from rlax_tasks.utils.byte_sizes import format_bytes
from rlax_tasks.utils.progress_meter import ProgressMeter

log = logging.getLogger(__name__)

CACHE_ENV = "RLAX_MODEL_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "rlax", "models")
MARKER_FILE = ".rlax-model-cache.json"
LOCK_FILE = ".rlax-model-cache.lock"
PARTIAL_SUFFIX = ".partial"
CONFIG_FILE = "config.json"
# what an HF model directory needs besides its weights (config, tokenizer, chat template)
METADATA_FILES = frozenset(
    {
        CONFIG_FILE,
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    }
)
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")
DEFAULT_WORKERS = 8
DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024
ATTEMPTS = 3  # listings tried when an object is replaced during the download


class ModelCacheError(RuntimeError):
    """A model file that cannot be fetched intact (its checksum keeps mismatching)."""


def is_model_file(name: str, weights: bool = True) -> bool:
    """Whether the cache fetches ``name`` (a file directly under the model prefix)."""
    return name in METADATA_FILES or (weights and name.endswith(WEIGHT_SUFFIXES))


def cache_root(cache_dir: str | None = None) -> str:
    """The cache directory: ``cache_dir``, else ``$RLAX_MODEL_CACHE``, else ~/.cache/rlax/models."""
    return os.path.expanduser(cache_dir or os.environ.get(CACHE_ENV) or DEFAULT_CACHE)


def cache_path(path: str, cache_dir: str | None = None) -> str:
    """Where the model at ``gs://bucket/prefix`` is kept: ``<cache>/bucket/prefix``."""
    bucket, _, prefix = path[len(storage.GCS_SCHEME) :].partition("/")
    parts = [p for p in prefix.split("/") if p]
    if not bucket or any(p in (".", "..") for p in parts):
        raise ValueError(f"model path {path!r}: expected gs://BUCKET/PREFIX without '.' or '..'")
    return os.path.join(cache_root(cache_dir), bucket, *parts)


def local_model_dir(
    path: str,
    cache_dir: str | None = None,
    *,
    weights: bool = True,
    workers: int = DEFAULT_WORKERS,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress_every_s: float | None = None,
) -> str:
    """A local HF model directory for ``path``: itself when local, else the verified cache copy
    of the gs:// directory (``<cache>/bucket/prefix``). ``weights=False`` fetches only config and
    tokenizer files (for processes that only tokenize, like the controller)."""
    if not storage.is_gcs(path):
        return path
    path = path.rstrip("/")  # one cache entry (and marker source) per directory
    target = cache_path(path, cache_dir)
    settings = _Settings(max(1, workers), max(1, chunk_bytes), progress_every_s)
    for attempt in range(1, ATTEMPTS + 1):
        listing = _list_model(path)
        wanted = {n: o for n, o in listing.items() if is_model_file(n, weights)}
        os.makedirs(target, exist_ok=True)
        with _locked(target, path):
            try:
                _sync(path, target, listing, wanted, settings)
                return target
            except storage.PreconditionFailedError as e:
                if attempt == ATTEMPTS:
                    raise ModelCacheError(f"{path}: objects keep changing during download") from e
                log.warning("%s changed during the download (%s); listing again", path, e)
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- listing
def _list_model(path: str) -> dict[str, storage.ObjectInfo]:
    """name -> metadata of the model files directly under ``path`` (every kind, weights too)."""
    objects = storage.list_objects(path, recursive=False)
    listing = {o.name: o for o in objects if is_model_file(o.name)}
    if CONFIG_FILE not in listing:
        found = ", ".join(sorted(o.name for o in objects)[:10]) or "nothing"
        raise FileNotFoundError(
            f"{storage.join(path, CONFIG_FILE)} does not exist: model.path must be a Hugging "
            f"Face model directory (config.json, *.safetensors, tokenizer files); found {found}"
        )
    if not any(n.endswith(".safetensors") for n in listing):
        raise FileNotFoundError(
            f"{path} holds no *.safetensors weights (found {', '.join(sorted(listing))})"
        )
    return listing


@contextlib.contextmanager
def _locked(target: str, path: str) -> Iterator[None]:
    """Holds the model directory's lock (one downloader per host; waits for another one)."""
    with open(os.path.join(target, LOCK_FILE), "a+b") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process downloading %s into %s", path, target)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# --------------------------------------------------------------------------- the marker
def _read_marker(target: str, path: str) -> dict[str, dict]:
    """name -> {generation, size} of the verified files (empty when missing or foreign)."""
    try:
        with open(os.path.join(target, MARKER_FILE), encoding="utf-8") as fh:
            marker = json.load(fh)
    except (FileNotFoundError, ValueError):
        return {}
    if not isinstance(marker, dict) or marker.get("source") != path:
        return {}
    files = marker.get("files")
    return dict(files) if isinstance(files, dict) else {}


def _write_marker(target: str, path: str, files: dict[str, dict]) -> None:
    tmp = os.path.join(target, MARKER_FILE + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({"source": path, "files": files}, fh, indent=1, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(target, MARKER_FILE))


def _record(obj: storage.ObjectInfo) -> dict:
    return {"generation": obj.generation, "size": obj.size, "crc32c": obj.crc32c, "md5": obj.md5}


def _is_current(target: str, entry: dict | None, obj: storage.ObjectInfo) -> bool:
    if entry is None or entry.get("generation") != obj.generation or entry.get("size") != obj.size:
        return False
    try:
        return os.path.getsize(os.path.join(target, obj.name)) == obj.size
    except OSError:
        return False


# --------------------------------------------------------------------------- the download
@dataclasses.dataclass(frozen=True)
class _Settings:
    workers: int
    chunk_bytes: int
    progress_every_s: float | None  # None: rlax_tasks.utils.progress_meter's default


def _sync(
    path: str,
    target: str,
    listing: dict[str, storage.ObjectInfo],
    wanted: dict[str, storage.ObjectInfo],
    settings: _Settings,
) -> None:
    """Brings ``target`` to the listed generations (the caller holds the lock)."""
    marker = _read_marker(target, path)
    for name in sorted(set(marker) - set(listing)):  # gone from the prefix: would mislead loaders
        log.info("model cache: %s is no longer under %s; removed", name, path)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(target, name))
        del marker[name]
    for name in os.listdir(target):  # left by an interrupted download
        if name.endswith(PARTIAL_SUFFIX):
            os.remove(os.path.join(target, name))
    todo = [o for n, o in sorted(wanted.items()) if not _is_current(target, marker.get(n), o)]
    todo.sort(key=lambda o: o.name.endswith(".safetensors"))  # small files first, then shards
    if not todo:
        return
    for obj in todo:  # a stale copy must not be mistaken for the new one if this run dies
        marker.pop(obj.name, None)
    _write_marker(target, path, marker)
    progress = ProgressMeter(
        f"model cache {path}",
        sum(o.size for o in todo),
        logger=log,
        every_s=settings.progress_every_s,
        format_count=format_bytes,
    )
    marker_lock = threading.Lock()

    def done(obj: storage.ObjectInfo) -> None:
        with marker_lock:
            marker[obj.name] = _record(obj)
            _write_marker(target, path, marker)

    jobs = [_FileJob(obj, target, progress, done) for obj in todo]
    _run_jobs(jobs, settings)
    progress.finish(f"-> {target}")


class _RangeWriter:
    """A write-only stream putting bytes at increasing offsets of an open file (``pwrite``)."""

    def __init__(self, fd: int, offset: int, progress: ProgressMeter) -> None:
        self.fd, self.offset, self.progress = fd, offset, progress

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            n = os.pwrite(self.fd, view, self.offset)
            self.offset += n
            view = view[n:]
        self.progress.update(len(data))
        return len(data)


class _FileJob:
    """One object fetched into ``NAME.partial`` by ranges; verified and renamed by the thread that
    writes its last range."""

    def __init__(
        self,
        obj: storage.ObjectInfo,
        target: str,
        progress: ProgressMeter,
        done: Callable[[storage.ObjectInfo], None],
    ) -> None:
        self.obj, self.progress, self.done = obj, progress, done
        self.final = os.path.join(target, obj.name)
        self.partial = self.final + PARTIAL_SUFFIX
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._left = 0

    def ranges(self, chunk_bytes: int) -> list[tuple[int, int]]:
        size = self.obj.size
        out = [(s, min(s + chunk_bytes, size)) for s in range(0, size, chunk_bytes)] or [(0, 0)]
        self._left = len(out)
        return out

    def _open(self) -> int:
        with self._lock:
            if self._fd is None:
                self._fd = os.open(self.partial, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
                os.ftruncate(self._fd, self.obj.size)
            return self._fd

    def fetch(self, start: int, end: int) -> None:
        """Fetches one range; the last one to finish verifies and publishes the file."""
        fd = self._open()
        writer = _RangeWriter(fd, start, self.progress)
        storage.download_range(self.obj.path, writer, start, end, self.obj.generation)
        if writer.offset != end:
            raise EOFError(f"{self.obj.path}: got bytes {start}..{writer.offset}, wanted ..{end}")
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def close(self) -> None:
        """Closes the partial file (after a failure: a later call fetches it again)."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def _finish(self) -> None:
        os.fsync(self._fd)
        self.close()
        problem = _verify(self.partial, self.obj)
        if problem:  # a transfer went wrong: fetch the whole file once more, in one stream
            log.warning("model cache: %s; fetching it again", problem)
            with open(self.partial, "wb") as fh:
                writer = _RangeWriter(fh.fileno(), 0, self.progress)
                storage.download_range(self.obj.path, writer, 0, self.obj.size, self.obj.generation)
                fh.flush()
                os.fsync(fh.fileno())
            problem = _verify(self.partial, self.obj)
            if problem:
                os.remove(self.partial)
                raise ModelCacheError(
                    f"{problem} twice: the object itself may be corrupt (re-upload it)"
                )
        os.replace(self.partial, self.final)
        self.done(self.obj)


def _run_jobs(jobs: list[_FileJob], settings: _Settings) -> None:
    """Fetches every range of every job on ``settings.workers`` threads, in job order; the first
    failure cancels what has not started and is raised."""
    pool = concurrent.futures.ThreadPoolExecutor(settings.workers, thread_name_prefix="model-cache")
    try:
        futures = [
            pool.submit(job.fetch, start, end)
            for job in jobs
            for start, end in job.ranges(settings.chunk_bytes)
        ]
        for future in concurrent.futures.as_completed(futures):
            future.result()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        for job in jobs:
            job.close()
        raise
    pool.shutdown(wait=True)


# --------------------------------------------------------------------------- verification
def _verify(file: str, obj: storage.ObjectInfo) -> str | None:
    """None when ``file`` matches the object's size and checksum, else what differs."""
    size = os.path.getsize(file)
    if size != obj.size:
        return f"{obj.path}: {size} bytes downloaded, the object has {obj.size}"
    if obj.crc32c:
        got = file_crc32c(file)
        if got != obj.crc32c:
            return f"{obj.path}: crc32c {got} of the download != {obj.crc32c} of the object"
    elif obj.md5:
        got = file_md5(file)
        if got != obj.md5:
            return f"{obj.path}: md5 {got} of the download != {obj.md5} of the object"
    else:
        log.warning("model cache: %s has no checksum in its metadata; size checked only", obj.path)
    return None


def file_crc32c(file: str, block: int = 8 * 1024 * 1024) -> str:
    """The base64 big-endian CRC32C of a file, as GCS reports it."""
    checksum = google_crc32c.Checksum()
    with open(file, "rb") as fh:
        while data := fh.read(block):
            checksum.update(data)
    return base64.b64encode(checksum.digest()).decode("ascii")


def file_md5(file: str, block: int = 8 * 1024 * 1024) -> str:
    """The base64 MD5 of a file, as GCS reports it."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(file, "rb") as fh:
        while data := fh.read(block):
            digest.update(data)
    return base64.b64encode(digest.digest()).decode("ascii")


__all__ = [
    "CACHE_ENV",
    "ModelCacheError",
    "cache_path",
    "cache_root",
    "is_model_file",
    "local_model_dir",
]
