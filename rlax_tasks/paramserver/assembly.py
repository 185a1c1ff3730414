"""Multi-host versions: each trainer host pushes its shards as one part; the parts gather in an
``Assembly``, committed once they tile every array, abandoned (every part told why) on a gap,
overlap, disagreement, corrupt part or timeout (docs/design.md §6)."""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time

from rlax_tasks.paramserver.errors import (
    NoRoomError,
    PartsMissingError,
    VersionConflictError,
    VersionTooLargeError,
)
from rlax_tasks.paramserver.versions import Block, WeightVersion
from rlax_tasks.paramserver.wire import Manifest, WireError, check_coverage, version_digest

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Assembly:
    """A multi-host version being assembled from its parts (one per trainer host)."""

    version: int
    parts: int
    started: float  # time.monotonic() when the first part's stream began
    deadline: float  # every part must have arrived by then
    manifest: Manifest | None = None  # the first part's: every part must send the same arrays
    received: dict[int, tuple[list[Block], bytes]] = dataclasses.field(default_factory=dict)
    arrivals: int = 0  # complete part streams received, repeats included
    streaming: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    weights: WeightVersion | None = None  # once committed
    error: tuple[type[Exception], str] | None = None  # once abandoned: what every part gets


class PartAssembly:
    """The multi-host half of ``VersionStore``, its base class: it shares the store's lock and
    pushes in flight, and uses the store's ``_check_newer_locked``, ``_claim_locked``,
    ``_make_room_locked``, ``_describe_locked`` and ``_commit_locked``."""

    assembly_timeout_s: float
    _cond: threading.Condition
    _pushing: dict
    _assemblies: dict[int, Assembly]

    def begin_part(self, version: int, part: int, parts: int) -> Assembly:
        """A stream of part ``part`` of ``parts`` of ``version`` starts; returns its assembly.

        The first part starts the assembly (claiming the reservation) and its timeout.
        VersionConflictError if not newer than the latest or pushed single-host; WireError
        (abandoning the assembly) if ``parts`` disagrees with the assembly's."""
        if not 0 <= part < parts:
            raise ValueError(f"part must be in [0, {parts}), got {part}")
        with self._cond:
            self._check_newer_locked(version)
            assembly = self._assemblies.get(version)
            if assembly is None:
                self._claim_locked(version, "by a single-host push")
                now = time.monotonic()
                assembly = Assembly(version, parts, now, now + self.assembly_timeout_s)
                self._assemblies[version] = assembly
                log.info("version %d: assembling %d parts (part %d first)", version, parts, part)
            self._check_parts_locked(assembly, parts)
            assembly.streaming[part] += 1
            return assembly

    def start_part(self, assembly: Assembly, part: int, manifest: Manifest) -> None:
        """A part's manifest arrived: the first sizes the version's room (at once, or
        NoRoomError), every later one must equal it (WireError naming the array). Either failure
        abandons the version."""
        with self._cond:
            self._raise_if_over_locked(assembly)
            v = assembly.version
            if assembly.manifest is not None:
                problem = _manifest_difference(assembly.manifest, manifest)
                if problem is not None:
                    self._abandon_locked(
                        assembly,
                        WireError,
                        f"part {part}'s manifest differs from the first part's: {problem}",
                    )
                    self._raise_if_over_locked(assembly)
                return
            push = self._pushing[v]
            try:
                if manifest.nbytes > push.nbytes and not self._make_room_locked(
                    v, manifest.nbytes, 0.0
                ):
                    raise NoRoomError(self._describe_locked(v, manifest.nbytes))
            except (NoRoomError, VersionTooLargeError, VersionConflictError) as e:
                self._abandon_locked(assembly, type(e), str(e))
                raise
            push.nbytes = manifest.nbytes
            assembly.manifest = manifest
            self._cond.notify_all()  # a smaller version frees room for the others

    def end_part_stream(self, assembly: Assembly, part: int) -> None:
        """A stream of ``part`` ended (arrived, broke or failed): no longer shown as streaming."""
        with self._cond:
            assembly.streaming[part] -= 1
            if assembly.streaming[part] <= 0:
                del assembly.streaming[part]

    def add_part(
        self, assembly: Assembly, part: int, blocks: list[Block], digest: bytes
    ) -> WeightVersion | None:
        """Part ``part`` arrived complete and verified (replacing an earlier copy of it).

        Returns the committed version after the last part (None before). Raises the version's
        error if abandoned, WireError (abandoning it) if the parts' regions overlap or leave a
        gap, VersionConflictError if it already committed."""
        with self._cond:
            self._raise_if_over_locked(assembly)
            v = assembly.version
            if part in assembly.received:
                log.info("version %d: part %d arrived again: it replaces the earlier copy", v, part)
            assembly.received[part] = (blocks, digest)
            assembly.arrivals += 1
            if len(assembly.received) < assembly.parts:
                return None
            try:
                weights = _assemble(assembly)
            except WireError as e:
                self._abandon_locked(assembly, WireError, str(e))
                raise
            del self._assemblies[v]  # committed below, not abandoned as an older assembly
            try:
                self._commit_locked(weights)
            except Exception as e:
                self._pushing.pop(v, None)
                self._abandon_locked(assembly, type(e), str(e))
                raise
            assembly.weights = weights
            self._cond.notify_all()
            log.info(
                "version %d assembled from %d parts in %.2fs",
                assembly.version,
                assembly.parts,
                time.monotonic() - assembly.started,
            )
            return weights

    def wait_assembled(self, assembly: Assembly) -> WeightVersion:
        """Waits until the version of ``assembly`` commits (returns it) or is abandoned (raises
        its error); abandons it (PartsMissingError) once its ``assembly_timeout_s`` is over."""
        with self._cond:
            while True:
                self._raise_if_over_locked(assembly, committed_ok=True)
                if assembly.weights is not None:
                    return assembly.weights
                left = assembly.deadline - time.monotonic()
                if left <= 0:
                    self._abandon_locked(
                        assembly, PartsMissingError, self._missing_message_locked(assembly)
                    )
                    continue
                self._cond.wait(left)

    def fail_part(self, assembly: Assembly, part: int, error: Exception) -> None:
        """A part's stream was malformed or corrupted: the version is abandoned with
        ``error``'s type, and every part waiting on it gets it; raises it here too."""
        with self._cond:
            if assembly.error is None and assembly.weights is None:
                self._abandon_locked(assembly, type(error), f"part {part}: {error}")
            self._raise_if_over_locked(assembly)

    def expire_assemblies(self) -> list[int]:
        """Abandons the versions whose parts did not all arrive in time; returns them."""
        with self._cond:
            now = time.monotonic()
            late = [a for a in self._assemblies.values() if now >= a.deadline]
            for assembly in late:
                self._abandon_locked(
                    assembly, PartsMissingError, self._missing_message_locked(assembly)
                )
            return [a.version for a in late]

    def assemblies(self) -> dict[str, dict]:
        """Versions being assembled: parts expected, received (and how many part streams
        arrived, repeats included) and streaming, bytes, age and time left."""
        with self._cond:
            now = time.monotonic()
            return {
                str(v): {
                    "parts": a.parts,
                    "received": sorted(a.received),
                    "arrivals": a.arrivals,
                    "streaming": sorted(a.streaming),
                    "bytes": None if a.manifest is None else a.manifest.nbytes,
                    "age_s": round(now - a.started, 3),
                    "timeout_in_s": round(max(a.deadline - now, 0.0), 3),
                }
                for v, a in sorted(self._assemblies.items())
            }

    def _check_parts_locked(self, assembly: Assembly, parts: int) -> None:
        if parts != assembly.parts:
            self._abandon_locked(
                assembly,
                WireError,
                f"a part says version {assembly.version} has {parts} parts, an earlier one "
                f"{assembly.parts} (every host must push with the same process count)",
            )
            self._raise_if_over_locked(assembly)

    def _raise_if_over_locked(self, assembly: Assembly, committed_ok: bool = False) -> None:
        if assembly.error is not None:
            kind, message = assembly.error
            raise kind(message)
        if assembly.weights is not None and not committed_ok:
            raise VersionConflictError(f"version {assembly.version} is already committed")

    def _abandon_locked(self, assembly: Assembly, kind: type[Exception], message: str) -> None:
        """Discards a version being assembled: its blocks and room go, its parts get ``kind``."""
        assembly.error = (kind, message)
        assembly.received.clear()
        if self._assemblies.get(assembly.version) is assembly:
            del self._assemblies[assembly.version]
            self._pushing.pop(assembly.version, None)
        log.warning("version %d abandoned: %s", assembly.version, message)
        self._cond.notify_all()

    def _missing_message_locked(self, assembly: Assembly) -> str:
        got = sorted(assembly.received)
        missing = [p for p in range(assembly.parts) if p not in assembly.received]
        shown = ", ".join(map(str, missing[:16])) + (", ..." if len(missing) > 16 else "")
        return (
            f"version {assembly.version} abandoned: {len(got)} of {assembly.parts} parts arrived "
            f"within assembly_timeout_s={self.assembly_timeout_s:g}s of the first (missing parts: "
            f"{shown}; a trainer host did not push it); the partial version was discarded"
        )

    def _joins_assembly_locked(self, version: int, parts: int | None) -> bool:
        assembly = self._assemblies.get(version)
        if parts is None or assembly is None:
            return False
        self._check_parts_locked(assembly, parts)
        return True


def _manifest_difference(first: Manifest, other: Manifest) -> str | None:
    """Where a part's manifest differs from the first part's (naming the array), or None."""
    if first.arrays == other.arrays:
        return None
    for i, spec in enumerate(first.arrays):
        if i >= len(other.arrays):
            return f"array {spec.name!r} is missing"
        got = other.arrays[i]
        if got.name != spec.name:
            return f"array #{i} is {got.name!r}, in the first part {spec.name!r}"
        if got != spec:
            return (
                f"array {spec.name!r} is {got.dtype}{list(got.shape)}, in the first part "
                f"{spec.dtype}{list(spec.shape)}"
            )
    return f"array {other.arrays[len(first.arrays)].name!r} is not in the first part's manifest"


def _assemble(assembly: Assembly) -> WeightVersion:
    """The complete version of an assembly: blocks ordered by (array, part, stream order), so
    each array's blocks are contiguous in the served stream; WireError unless they tile every
    array exactly."""
    manifest = assembly.manifest
    assert manifest is not None  # a part's blocks arrive after its manifest
    ordered = [
        (block.header.array, part, i, block)
        for part, (blocks, _) in assembly.received.items()
        for i, block in enumerate(blocks)
    ]
    ordered.sort(key=lambda t: t[:3])
    blocks = [t[3] for t in ordered]
    check_coverage(manifest, (b.header for b in blocks))
    whole = Manifest(manifest.version, manifest.arrays, len(blocks))
    digest = version_digest(whole, [b.header for b in blocks])
    parts = tuple(assembly.received[p][1] for p in range(assembly.parts))
    return WeightVersion(whole, blocks, digest, parts)
