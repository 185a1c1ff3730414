"""Full garbage collections are the long-running process's, at its step boundaries."""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from rlax_tasks.process import garbage_collection


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def full_collections() -> list[int]:
    """The generation of every collection the automatic collector or gc.collect ran."""
    seen: list[int] = []

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)
        garbage_collection.restore_defaults()


def _grow_long_lived_heap(n: int | None = None) -> list:
    """Enough surviving containers that the automatic collector starts full collections: it
    starts one once the long-lived objects grew by a quarter, so a process that already holds
    millions (the whole test suite's imports and fixtures) needs half its heap again."""
    if n is None:
        n = max(300_000, len(gc.get_objects()) // 2)
    return [[i] for i in range(n)]


def test_the_automatic_collector_runs_full_collections_unless_they_are_deferred(
    full_collections: list[int],
) -> None:
    kept = _grow_long_lived_heap()
    assert 2 in full_collections, "control: growing the heap triggers a full collection"
    del kept
    full_collections.clear()

    garbage_collection.defer_full_collections(every_s=60.0)
    kept = _grow_long_lived_heap()
    assert full_collections, "the young generations are still collected automatically"
    assert 2 not in full_collections
    del kept


def test_a_due_collection_frees_cyclic_garbage_and_an_early_one_does_not_run(
    full_collections: list[int],
) -> None:
    assert garbage_collection.collect_if_due() is None, "nothing deferred: the collector's job"
    garbage_collection.defer_full_collections(every_s=10.0)
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    gc.collect(1)  # the cycle survives two young collections: it now waits for a full one
    gc.collect(1)
    del a, b
    full_collections.clear()

    assert garbage_collection.collect_if_due(now=_later(5.0)) is None
    assert gone() is not None and 2 not in full_collections

    took = garbage_collection.collect_if_due(now=_later(11.0))
    assert took is not None and took >= 0
    assert gone() is None, "the full collection freed the cycle"
    assert 2 in full_collections
    assert garbage_collection.collect_if_due(now=_later(12.0)) is None, "next one in 10 s"


def test_start_up_objects_are_frozen_out_of_later_walks(full_collections: list[int]) -> None:
    garbage_collection.defer_full_collections()
    loaded = _grow_long_lived_heap(1000)
    frozen = garbage_collection.freeze_startup()
    # a frozen object leaves the count only when freed (another thread, e.g. xdist's, may free a
    # few in between)
    assert frozen >= 1000 and frozen - 100 < gc.get_freeze_count() <= frozen
    assert not _walked(loaded), "a collection's generations no longer hold them"
    garbage_collection.restore_defaults()
    assert gc.get_freeze_count() == 0 and _walked(loaded)


def _walked(x: object) -> bool:
    return any(o is x for o in gc.get_objects())


def test_a_bad_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="every_s"):
        garbage_collection.defer_full_collections(every_s=0)


def _later(seconds: float) -> float:
    return time.monotonic() + seconds
