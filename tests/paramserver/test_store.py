"""The garbage-collection rule and worker bookkeeping (docs/design.md §6), without the network."""

import time

import numpy as np
import pytest

from rlax_tasks.paramserver.errors import (
    NoRoomError,
    UnknownVersionError,
    VersionConflictError,
    VersionTooLargeError,
)
from rlax_tasks.paramserver.store import VersionStore
from rlax_tasks.paramserver.versions import WeightVersion
from rlax_tasks.paramserver.wire import ArraySpec, Manifest


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _version(v: int) -> WeightVersion:
    return WeightVersion(Manifest(v, (), 0), [], bytes(32))


def _store(keep=2, timeout=10.0):
    clock = Clock()
    return VersionStore(keep, timeout, clock=clock), clock


def test_keeps_the_newest_keep_versions_without_workers():
    store, _ = _store(keep=2)
    for v in (1, 2, 3, 5):
        store.commit(_version(v))
    assert store.versions() == [3, 5]
    assert store.latest_version() == 5


def test_versions_strictly_increase():
    store, _ = _store()
    store.commit(_version(4))
    with pytest.raises(VersionConflictError):
        store.begin_push(4)
    with pytest.raises(VersionConflictError):
        store.commit(_version(3))
    store.begin_push(6)
    with pytest.raises(VersionConflictError, match="already being pushed"):
        store.begin_push(6)
    # a single-host stream holds the version: a multi-host part of it is refused, and says why
    with pytest.raises(VersionConflictError, match="being pushed by a single-host push"):
        store.begin_part(6, 0, 2)
    assert store.assemblies() == {}
    store.end_push(6)
    assembly = store.begin_part(6, 1, 2)  # the stream ended: the parts may claim it now
    assert store.assemblies()["6"]["streaming"] == [1] and assembly.parts == 2


def test_old_version_goes_only_when_every_worker_acked_a_newer_one():
    store, _ = _store(keep=1)
    store.commit(_version(1))
    store.touch("a")  # registered, acked nothing: holds everything
    store.touch("b")
    store.commit(_version(2))
    store.commit(_version(3))
    assert store.versions() == [1, 2, 3]
    store.ack("a", 3)
    store.ack("b", 2)
    # b still runs version 2: only versions older than 2 may go
    assert store.versions() == [2, 3]
    store.ack("b", 3)
    assert store.versions() == [3]
    with pytest.raises(UnknownVersionError):
        store.ack("a", 9)


def test_deregistered_and_timed_out_workers_release_their_versions():
    store, clock = _store(keep=1, timeout=5.0)
    store.commit(_version(1))
    store.ack("gone", 1)
    store.ack("silent", 1)
    store.commit(_version(2))
    assert store.versions() == [1, 2]
    store.deregister("gone")
    assert store.versions() == [1, 2]  # "silent" still holds 1
    clock.t = 4.0
    assert store.expire_workers() == ([], [])
    clock.t = 5.5
    dropped, deleted = store.expire_workers()
    assert dropped == ["silent"] and deleted == [1]
    assert store.versions() == [2]


def test_newest_version_is_never_deleted_and_wait_for_times_out():
    store, _ = _store(keep=1)
    assert store.wait_for(None, 0.01) is None
    store.commit(_version(7))
    assert store.wait_for(None, 0.0).version == 7
    assert store.wait_for(8, 0.05) is None
    assert store.versions() == [7]
    np.testing.assert_equal(store.get(7).version, 7)
    with pytest.raises(UnknownVersionError):
        store.get(6)


# --------------------------------------------------------------------------- keep_bytes
def _sized(v: int, nbytes: int) -> WeightVersion:
    """A version whose manifest declares ``nbytes`` of payload (no memory behind it)."""
    return WeightVersion(Manifest(v, (ArraySpec("w", "uint8", (nbytes,)),), 0), [], bytes(32))


def _push(store: VersionStore, v: int, nbytes: int) -> None:
    """What the server does for one push: reserve, stream (claim + size), commit."""
    store.reserve(v, nbytes)
    store.begin_push(v)
    store.fit_push(v, nbytes)
    store.commit(_sized(v, nbytes))
    store.end_push(v)


def _in_use(store: VersionStore) -> int:
    memory = store.memory()
    return memory["bytes_held"] + memory["bytes_in_flight"]


def test_keep_bytes_deletes_the_oldest_unneeded_versions_until_the_new_one_fits():
    store = VersionStore(10, 10.0, clock=Clock(), keep_bytes=300)
    for v in (1, 2, 3):
        _push(store, v, 100)
    assert store.versions() == [1, 2, 3]  # within keep_versions and keep_bytes: all kept
    _push(store, 4, 100)
    assert store.versions() == [2, 3, 4]  # the oldest went to make room, no more
    _push(store, 5, 200)
    assert store.versions() == [4, 5]
    assert store.memory()["bytes_held"] == 300 and _in_use(store) == 300


def test_pushes_in_flight_count_against_keep_bytes():
    store = VersionStore(10, 10.0, clock=Clock(), keep_bytes=300)
    _push(store, 1, 100)
    store.reserve(2, 100)  # reserved, stream not started yet
    store.begin_push(3)
    store.fit_push(3, 100)  # stream being received
    assert store.memory()["bytes_in_flight"] == 200 and _in_use(store) == 300
    with pytest.raises(NoRoomError, match=r"version 4 waits for room: needs 100 bytes"):
        store.reserve(4, 100)
    store.begin_push(5)  # a stream without a reservation gets room at once or not at all
    with pytest.raises(NoRoomError):
        store.fit_push(5, 100)
    store.end_push(5)
    store.end_push(2)  # a push that failed: its room is free again
    store.reserve(4, 100)
    assert _in_use(store) == 300


def test_a_reservation_no_stream_claims_lapses():
    clock = Clock()
    store = VersionStore(10, 10.0, clock=clock, keep_bytes=200)
    _push(store, 1, 100)
    store.reserve(2, 100, lease_s=5.0)
    with pytest.raises(NoRoomError):
        store.reserve(3, 100)
    clock.t = 6.0
    store.expire_workers()
    assert store.memory()["bytes_in_flight"] == 0
    store.reserve(3, 100)


def test_a_version_that_can_never_fit_is_refused_at_once_naming_both_numbers():
    store = VersionStore(10, 10.0, clock=Clock(), keep_bytes=300)
    t0 = time.monotonic()
    with pytest.raises(VersionTooLargeError, match=r"version 1 is 301 bytes.*keep_bytes=300"):
        store.reserve(1, 301, wait_s=30.0)
    _push(store, 1, 200)
    # fits alone, but never beside the newest version, which stays until it is replaced
    with pytest.raises(VersionTooLargeError, match=r"200 \+ 200 > keep_bytes=300"):
        store.reserve(2, 200, wait_s=30.0)
    assert time.monotonic() - t0 < 5.0
    assert store.memory()["bytes_in_flight"] == 0 and store.memory()["waiting_for_room"] == []


def test_without_keep_bytes_only_keep_versions_limits():
    store = VersionStore(2, 10.0, clock=Clock())
    for v in (1, 2, 3, 4):
        _push(store, v, 10**12)  # a terabyte each: no byte limit applies
    assert store.versions() == [3, 4]
    memory = store.memory()
    assert memory["keep_bytes"] is None and memory["bytes_held"] == 2 * 10**12
    store.touch("w")  # acked nothing: holds every version, as before
    _push(store, 5, 10**12)
    assert store.versions() == [3, 4, 5]
