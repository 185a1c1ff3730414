"""Snapshots: atomic pointer commit, crash before commit, integrity, local and gs://."""

from __future__ import annotations

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
