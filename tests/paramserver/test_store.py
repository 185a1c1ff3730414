"""The garbage-collection rule and worker bookkeeping (DESIGN §6), without the network."""

import numpy as np
import pytest

from rlax_tasks.paramserver.store import (
    UnknownVersionError,
    VersionConflictError,
    VersionStore,
    WeightVersion,
)
from rlax_tasks.paramserver.wire import Manifest


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
