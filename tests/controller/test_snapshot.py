"""Snapshots: atomic pointer commit, crash before commit, integrity, local and gs://."""

from __future__ import annotations

import dataclasses
import os

import pytest

from rlax_tasks.controller import Snapshot, SnapshotError, SnapshotStore
from rlax_tasks.rundir import storage
from tests.paramserver.helpers import gcs_emulator


@pytest.fixture(scope="module")
def gcs_root():
    with gcs_emulator("snapshot-test") as bucket:
        yield bucket


@pytest.fixture(params=["local", "gcs"])
def run_dir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return storage.join(
        request.getfixturevalue("gcs_root"), request.node.name.replace("[", "_").replace("]", "")
    )


def snap(step: int, groups: int = 1) -> Snapshot:
    g = {
        "prompt_id": f"a/0/{step}",
        "seq": step,
        "version": step - 1,
        "prompt_tokens": [1, 2],
        "completions": [[3], [4, 5]],
        "logprobs": [[-0.1], [-0.2, -0.30000000000000004]],
        "finish_reasons": ["eos", "length"],
        "scores": [1.0, 0.0],
        "rewards": [1.0, -0.5],
    }
    return Snapshot(
        step=step,
        version=step,
        seed=0,
        mixture={"draws": step * 3},
        in_flight=[{"prompt_id": "b/0/1", "seq": 9, "worker": "w0"}],
        queued=[{"prompt_id": "b/0/2", "seq": 10}],
        buffer={"groups": [g] * groups, "dropped": [], "counts": {"stale": 1, "zero_variance": 0}},
        steps=[{"step": step, "prompt_ids": ["x"]}],
        counters={"issued": 4},
    )


def test_round_trip_and_latest(run_dir):
    store = SnapshotStore(run_dir)
    assert store.load_latest() is None
    store.write(snap(2))
    store.write(snap(4, groups=0))
    written = snap(6, groups=2)
    store.write(written)
    assert written == snap(6, groups=2)  # writing leaves the caller's snapshot as it was
    loaded = SnapshotStore(run_dir).load_latest()
    assert loaded == snap(6, groups=2)  # floats and nested lists round-trip exactly
    assert loaded.in_flight_ids == ["b/0/1"] and loaded.buffered_ids == ["a/0/6"] * 2


def test_crash_between_write_and_pointer_commit_keeps_previous(run_dir, monkeypatch):
    store = SnapshotStore(run_dir)
    store.write(snap(2))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(storage, "commit_pointer", killed)
    with pytest.raises(KeyboardInterrupt):
        store.write(snap(4))
    monkeypatch.undo()
    assert storage.exists(storage.join(run_dir, "snapshots", "4.json"))
    assert SnapshotStore(run_dir).load_latest().step == 2


def test_tampered_snapshot_is_rejected(tmp_path):
    store = SnapshotStore(str(tmp_path))
    store.write(snap(2))
    path = storage.join(str(tmp_path), "snapshots", "2.json")
    storage.write_bytes(path, storage.read_bytes(path).replace(b'"step": 2', b'"step": 3'))
    with pytest.raises(SnapshotError, match="sha256"):
        SnapshotStore(str(tmp_path)).load_latest()


def test_second_writer_loses_the_pointer_race(tmp_path):
    a, b = SnapshotStore(str(tmp_path)), SnapshotStore(str(tmp_path))
    a.write(snap(2))
    b.load_latest()
    a.write(snap(4))
    with pytest.raises(storage.PreconditionFailedError, match="another controller"):
        b.write(snap(4))
    assert SnapshotStore(str(tmp_path)).load_latest().step == 4


def test_old_snapshots_are_pruned(tmp_path):
    store = SnapshotStore(str(tmp_path), keep=2)
    for step in (1, 2, 3, 4):
        store.write(snap(step))
    names = storage.list_children(storage.join(str(tmp_path), "snapshots"))
    assert [n for n in names if n.endswith(".json")] == ["3.json", "4.json"]
    assert store.load_latest().step == 4


def test_partial_rollouts_round_trip_and_are_pruned_with_their_snapshot(tmp_path):
    rows = [
        {"prompt_id": "b/0/1", "sample": 0, "tokens": [5, 6], "logprobs": [-0.5, -0.25],
         "versions": [3, 4], "support": None, "finish_reason": None},
        {"prompt_id": "b/0/1", "sample": 2, "tokens": [7], "logprobs": [-1.0],
         "versions": [4], "support": [[7, 9]], "finish_reason": "eos"},
    ]  # fmt: skip
    store = SnapshotStore(str(tmp_path), keep=1)
    store.write(dataclasses.replace(snap(2), partials=rows))
    assert SnapshotStore(str(tmp_path)).load_latest().partials == rows
    store.write(snap(3))  # none held: no file, and step 2's files are pruned
    names = storage.list_children(storage.join(str(tmp_path), "snapshots"))
    assert sorted(n for n in names if n != "LATEST.lock") == [
        "3.buffer.parquet",
        "3.json",
        "LATEST",
    ]
    assert store.load_latest().partials == []


def test_a_reader_beside_a_live_controller_changes_nothing(tmp_path):
    """``read_latest`` of a snapshot the controller pruned meanwhile gives None and leaves the
    files as they are (``load_latest`` would set them aside as damaged)."""
    store = SnapshotStore(str(tmp_path), keep=1)
    store.write(dataclasses.replace(snap(2), partials=[]))
    assert SnapshotStore(str(tmp_path)).read_latest() == snap(2)
    folder = storage.join(str(tmp_path), "snapshots")
    os.remove(os.path.join(folder, "2.buffer.parquet"))  # as a prune under the reader would
    before = sorted(storage.list_children(folder))
    assert SnapshotStore(str(tmp_path)).read_latest() is None
    assert sorted(storage.list_children(folder)) == before
