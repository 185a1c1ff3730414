"""Durable mirror of weight versions: ``run_root/weights/v<version>/`` (local dir or gs://).

Each version holds ``blocks.bin`` (its wire stream) then ``COMMIT``, written last: a version
without it is ignored and removed at the next start. Mirroring runs on a background thread
(only the newest pending version is written); a restarted server loads the newest committed one."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from typing import Any

import numpy as np

from rlax_tasks.paramserver import wire
from rlax_tasks.paramserver.errors import VersionGoneError
from rlax_tasks.paramserver.versions import Block, WeightVersion
from rlax_tasks.paramserver.wire import BlockHeader, ChecksumError, Manifest, WireError
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths

log = logging.getLogger(__name__)

COMMIT = "COMMIT"
DATA = "blocks.bin"
_VERSION_DIR = re.compile(r"^v(\d+)$")


def weights_root(run_root: str) -> str:
    return run_paths(run_root).weights


def version_dir(run_root: str, version: int) -> str:
    return storage.join(weights_root(run_root), f"v{version}")


def write_version(run_root: str, weights: WeightVersion) -> None:
    """Writes one version (data first, COMMIT marker last)."""
    prefix = version_dir(run_root, weights.version)
    storage.delete_prefix(prefix)  # leftovers of an interrupted earlier attempt
    with weights.pinned(), storage.open_write(storage.join(prefix, DATA)) as fh:
        for frame in weights.frames():
            fh.write(frame)
    marker = {
        "version": weights.version,
        "digest": weights.digest.hex(),
        "parts": [d.hex() for d in weights.part_digests],  # a multi-host version's parts
        "bytes": weights.stream_length(),
        "time": time.time(),
    }
    storage.write_bytes(storage.join(prefix, COMMIT), json.dumps(marker).encode())


def mirrored_versions(run_root: str) -> tuple[list[int], list[int]]:
    """(committed, uncommitted) version numbers found under run_root/weights, ascending."""
    committed, partial = [], []
    root = weights_root(run_root)
    for name in storage.list_children(root):
        m = _VERSION_DIR.match(name)
        if not m:
            continue
        v = int(m.group(1))
        (committed if storage.exists(storage.join(root, name, COMMIT)) else partial).append(v)
    return sorted(committed), sorted(partial)


def newest_committed(run_root: str) -> int | None:
    """The newest committed version under run_root/weights (None: none yet); read only, so a
    version being written stays."""
    committed, _ = mirrored_versions(run_root)
    return committed[-1] if committed else None


def read_version(run_root: str, version: int) -> WeightVersion:
    """Loads a committed version, checking every block's CRC32C (sha256 in a format-1 mirror)
    and the version digest; ChecksumError names the block and its array."""
    prefix = version_dir(run_root, version)
    marker = json.loads(storage.read_bytes(storage.join(prefix, COMMIT)))
    with storage.open_read(storage.join(prefix, DATA)) as fh:
        manifest = wire.read_manifest(fh, (wire.FORMAT, *wire.LEGACY_FORMATS))
        if manifest.version != version:
            raise WireError(f"{prefix} holds version {manifest.version}, not {version}")
        if manifest.format != wire.FORMAT:
            return _read_v1(fh, manifest, prefix)
        blocks = []
        for i in range(manifest.num_blocks):
            header = wire.read_block_header(fh, manifest)
            data = np.empty(header.nbytes, np.uint8)
            storage.read_into(fh, memoryview(data))
            if wire.crc32c(data) != header.crc32c:
                name = manifest.arrays[header.array].name
                raise ChecksumError(f"{prefix}: block {i} (array {name!r}) fails its CRC32C")
            blocks.append(Block(header, data))
        wire.read_end(fh, manifest, [b.header for b in blocks])
    parts = tuple(bytes.fromhex(d) for d in marker.get("parts") or ())
    digest = wire.version_digest(manifest, [b.header for b in blocks])  # the end frame's
    return WeightVersion(manifest, blocks, digest, parts)


def _read_v1(fh: Any, manifest: Manifest, prefix: str) -> WeightVersion:
    """The rest of a format-1 mirror (blocks with a sha256), verified, as a current version."""
    blocks, hashes = [], []
    for i in range(manifest.num_blocks):
        old = wire.read_block_header_v1(fh, manifest)
        data = np.empty(old.nbytes, np.uint8)
        storage.read_into(fh, memoryview(data))
        if hashlib.sha256(data).digest() != old.sha256:
            name = manifest.arrays[old.array].name
            raise ChecksumError(f"{prefix}: block {i} (array {name!r}) fails its sha256")
        hashes.append(old.sha256)
        header = BlockHeader(old.array, old.start, old.stop, old.nbytes, wire.crc32c(data))
        blocks.append(Block(header, data))
    wire.read_end_v1(fh, manifest, hashes)
    current = Manifest(manifest.version, manifest.arrays, manifest.num_blocks)
    log.info("%s: a format-1 mirror (sha256 blocks), verified and re-checksummed", prefix)
    return WeightVersion(current, blocks, wire.version_digest(current, [b.header for b in blocks]))


def load_latest(run_root: str) -> WeightVersion | None:
    """The newest committed, intact version under run_root (older ones if it is damaged)."""
    committed, partial = mirrored_versions(run_root)
    for v in partial:
        log.warning("removing uncommitted mirror %s", version_dir(run_root, v))
        storage.delete_prefix(version_dir(run_root, v))
    for v in reversed(committed):
        try:
            weights = read_version(run_root, v)
        except (WireError, EOFError, ValueError, KeyError, FileNotFoundError) as e:
            log.error("mirror of version %d is unreadable (%s); trying an older one", v, e)
            continue
        log.info("restored version %d from %s", v, version_dir(run_root, v))
        return weights
    return None


class Mirror:
    """Background writer of every ``every``-th version; keeps the newest ``keep`` mirrors."""

    def __init__(self, run_root: str, every: int = 1, keep: int = 2) -> None:
        if every < 1:
            raise ValueError(f"mirror_every must be >= 1, got {every}")
        if keep < 1:
            raise ValueError(f"mirror_keep must be >= 1, got {keep}")
        self.run_root, self.every, self.keep = run_root, every, keep
        self._cond = threading.Condition()
        self._pending: WeightVersion | None = None
        self._busy = False
        self._closed = False
        self.last_committed: int | None = None
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name="ps-mirror", daemon=True)
        self._thread.start()

    def submit(self, weights: WeightVersion) -> bool:
        """Queues a version if it is a mirror_every-th one (replacing an older pending one)."""
        if weights.version % self.every:
            return False
        with self._cond:
            if self._pending is not None:
                log.info(
                    "mirror: skipping version %d for newer %d",
                    self._pending.version,
                    weights.version,
                )
            self._pending = weights
            self._cond.notify_all()
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        """Waits until nothing is pending or being written; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout_s: float = 30.0) -> None:
        """Finishes the pending write (up to timeout_s), then stops the thread."""
        self.wait_idle(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed and self._pending is None:
                    return
                weights, self._pending, self._busy = self._pending, None, True
            try:
                t0 = time.perf_counter()
                write_version(self.run_root, weights)
                self.last_committed = weights.version
                log.info(
                    "mirrored version %d to %s in %.2fs",
                    weights.version,
                    version_dir(self.run_root, weights.version),
                    time.perf_counter() - t0,
                )
                self._prune()
            except VersionGoneError:  # garbage-collected before its turn: a newer one follows
                log.info("version %d left memory before it was mirrored", weights.version)
            except Exception:  # noqa: BLE001 - storage errors must not kill the server
                self.errors += 1
                log.exception("mirroring version %d failed", weights.version)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _prune(self) -> None:
        committed, _ = mirrored_versions(self.run_root)
        for v in committed[: -self.keep]:
            storage.delete_prefix(version_dir(self.run_root, v))
            log.info("mirror: removed old version %d", v)
