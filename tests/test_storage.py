"""rlax_tasks.rundir.storage on a local directory and on GCS (real client, local emulator)."""

from __future__ import annotations

import gc
import os
import threading

import pytest

from rlax_tasks.rundir import storage
from tests.paramserver.helpers import gcs_emulator


@pytest.fixture(scope="module")
def gcs_root():
    with gcs_emulator("storage-test") as bucket:
        yield storage.join(bucket, "prefix")


@pytest.fixture(params=["local", "gcs"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "store")
    base = request.getfixturevalue("gcs_root")
    return storage.join(base, request.node.name.replace("[", "_").replace("]", ""))


def test_join_and_scheme():
    assert storage.join("gs://b/", "x/", "/y") == "gs://b/x/y"
    assert storage.join("/tmp/a", "b", "c.txt") == "/tmp/a/b/c.txt"
    assert storage.is_gcs("gs://b/x") and not storage.is_gcs("/tmp/x")
    with pytest.raises(ValueError, match="bucket"):
        storage.read_bytes("gs:///x")


def test_bytes_exists_list_delete(root):
    a, b = storage.join(root, "d", "a.bin"), storage.join(root, "d", "sub", "b.bin")
    assert not storage.exists(a)
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(a)
    storage.write_bytes(a, b"alpha")
    storage.write_bytes(b, b"beta")
    storage.write_bytes(storage.join(root, "other"), b"o")
    assert storage.exists(a) and storage.read_bytes(b) == b"beta"
    assert storage.list_prefix(storage.join(root, "d")) == [a, b]
    assert storage.list_children(storage.join(root, "d")) == ["a.bin", "sub"]
    assert storage.list_children(root) == ["d", "other"]
    storage.delete_prefix(storage.join(root, "d"))
    assert storage.list_prefix(storage.join(root, "d")) == []
    assert storage.read_bytes(storage.join(root, "other")) == b"o"
    storage.delete_prefix(storage.join(root, "missing"))  # no error


def test_streaming_write_and_read_in_chunks(root):
    path = storage.join(root, "big.bin")
    data = os.urandom(3 * 1024 * 1024 + 17)
    with storage.open_write(path) as fh:
        for i in range(0, len(data), 1_000_003):
            fh.write(data[i : i + 1_000_003])
    got = bytearray(len(data))
    with storage.open_read(path) as fh:
        storage.read_into(fh, memoryview(got))
        assert fh.read(1) == b""
    assert bytes(got) == data


def test_failed_streaming_write_leaves_no_object(root):
    path = storage.join(root, "never.bin")
    with pytest.raises(RuntimeError), storage.open_write(path) as fh:
        fh.write(b"x" * 1000)
        raise RuntimeError("writer died")
    gc.collect()  # a half-written GCS upload must not be finalised when the writer is freed
    assert not storage.exists(path)
    if not storage.is_gcs(root):
        assert storage.list_prefix(root) == []  # no temp file left behind


def test_commit_pointer_generations(root):
    path = storage.join(root, "LATEST")
    assert storage.read_versioned(path) == (None, 0)
    g1 = storage.commit_pointer(path, b"step-1", if_generation_match=0)
    data, gen = storage.read_versioned(path)
    assert data == b"step-1" and gen == g1 != 0
    g2 = storage.commit_pointer(path, b"step-2", if_generation_match=g1)
    assert g2 != g1 and storage.read_versioned(path) == (b"step-2", g2)
    g3 = storage.commit_pointer(path, b"step-3")  # unconditional
    assert storage.read_versioned(path)[1] == g3


def test_commit_pointer_rejects_a_stale_generation(root):
    path = storage.join(root, "LATEST")
    g1 = storage.commit_pointer(path, b"a", if_generation_match=0)
    with pytest.raises(storage.PreconditionFailedError):
        storage.commit_pointer(path, b"b", if_generation_match=0)
    storage.commit_pointer(path, b"c", if_generation_match=g1)
    with pytest.raises(storage.PreconditionFailedError):
        storage.commit_pointer(path, b"d", if_generation_match=g1)
    assert storage.read_bytes(path) == b"c"


def test_concurrent_compare_and_swap_has_one_winner_per_generation(root):
    path = storage.join(root, "ptr")
    storage.commit_pointer(path, b"0")
    wins = []

    def writer(i: int) -> None:
        for _ in range(20):
            data, gen = storage.read_versioned(path)
            try:
                storage.commit_pointer(path, str(int(data) + 1).encode(), if_generation_match=gen)
                wins.append(i)
            except storage.PreconditionFailedError:
                pass

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # no lost update: the counter equals the number of successful swaps
    assert int(storage.read_bytes(path)) == len(wins)


def test_read_jsonl_keeps_whole_objects_and_skips_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    assert storage.read_jsonl(str(path)) == []  # not written yet
    path.write_text('{"step": 1}\n[1, 2]\n{"step": 2}\n{"step": 3, "rew')  # cut by a crash
    assert storage.read_jsonl(str(path)) == [{"step": 1}, {"step": 2}]
