"""rlax_tasks.models.model_cache: gs:// HF model directories cached locally (GCS emulator)."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading

import pytest

from rlax_tasks.models import model_cache
from rlax_tasks.models.model_cache import MARKER_FILE, ModelCacheError, local_model_dir
from rlax_tasks.rundir import storage

SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
CHUNK = 64 * 1024  # several ranges per shard
FAST = dict(workers=4, chunk_bytes=CHUNK)


@pytest.fixture
def model(gcs_bucket, request):
    """gs:// path of an HF directory: the files a loader needs, plus some it does not."""
    path = storage.join(gcs_bucket, "org", request.node.name)
    rng = random.Random(request.node.name)
    files = {
        "config.json": b'{"model_type": "qwen2", "hidden_size": 8}',
        "generation_config.json": b'{"eos_token_id": [1, 2]}',
        "tokenizer.json": b'{"version": "1.0"}',
        "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
        "model.safetensors.index.json": json.dumps({"weight_map": {"a": SHARD_1}}).encode(),
        SHARD_1: rng.randbytes(5 * CHUNK + 123),
        SHARD_2: rng.randbytes(3 * CHUNK),
    }
    for name, data in files.items():
        storage.write_bytes(storage.join(path, name), data)
    storage.write_bytes(storage.join(path, "README.md"), b"not needed")
    storage.write_bytes(storage.join(path, "original", "consolidated.00.pth"), b"not needed")
    return path, files


class Downloads:
    """Records every ranged download (file name, start, end); ``hook`` may change a call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.hook = None
        self._real = storage.download_range
        self._lock = threading.Lock()
        monkeypatch.setattr(storage, "download_range", self)

    def __call__(self, path, out, start, end, generation=None):  # noqa: ANN001, ANN204
        name = path.rsplit("/", 1)[-1]
        with self._lock:
            self.calls.append((name, start, end))
        if self.hook is not None:
            out = self.hook(name, start, end, out) or out
        return self._real(path, out, start, end, generation)

    def names(self) -> set[str]:
        return {name for name, _, _ in self.calls}

    def bytes_of(self, name: str) -> int:
        return sum(end - start for n, start, end in self.calls if n == name)

    def reset(self) -> None:
        self.calls.clear()
        self.hook = None


def read_dir(path: str) -> dict[str, bytes]:
    out = {}
    for name in os.listdir(path):
        if not name.startswith(".rlax-model-cache"):
            with open(os.path.join(path, name), "rb") as fh:
                out[name] = fh.read()
    return out


def test_download_is_ranged_verified_and_happens_once(model, tmp_path, monkeypatch, caplog):
    path, files = model
    downloads = Downloads(monkeypatch)
    cache = str(tmp_path / "cache")
    with caplog.at_level(logging.INFO, logger=model_cache.__name__):
        local = local_model_dir(path, cache, progress_every_s=0.0, **FAST)
    bucket, key = path[len("gs://") :].split("/", 1)
    assert local == os.path.join(cache, bucket, *key.split("/"))
    assert read_dir(local) == files  # README.md and original/ are not fetched
    assert sum(1 for n, _, _ in downloads.calls if n == SHARD_1) == 6  # parallel ranges
    assert downloads.bytes_of(SHARD_1) == len(files[SHARD_1])
    assert re.search(r"\d [KMG]iB/s", caplog.text) and path in caplog.text  # progress lines
    assert not [n for n in os.listdir(local) if n.endswith(".partial")]

    downloads.reset()
    assert local_model_dir(path, cache, **FAST) == local
    assert downloads.calls == []  # complete and unchanged: nothing fetched again
    monkeypatch.setenv(model_cache.CACHE_ENV, cache)
    assert local_model_dir(path) == local  # $RLAX_MODEL_CACHE is the default cache
    assert local_model_dir(str(tmp_path)) == str(tmp_path)  # a local path stays as it is


def test_a_prefix_without_config_names_the_missing_object(gcs_bucket, tmp_path):
    storage.write_bytes(storage.join(gcs_bucket, "not-a-model", "weights.safetensors"), b"x")
    with pytest.raises(FileNotFoundError, match=f"{gcs_bucket}/not-a-model/config.json"):
        local_model_dir(storage.join(gcs_bucket, "not-a-model"), str(tmp_path))
    with pytest.raises(FileNotFoundError, match="config.json"):
        local_model_dir(storage.join(gcs_bucket, "nothing-here"), str(tmp_path))


def flip_first_byte(out):  # noqa: ANN001, ANN201
    class Corrupting:
        def __init__(self) -> None:
            self.first = True

        def write(self, data: bytes) -> int:
            if self.first and data:
                self.first = False
                data = bytes([data[0] ^ 0xFF]) + bytes(data[1:])
            return out.write(data)

    return Corrupting()


def test_a_corrupted_transfer_is_fetched_again(model, tmp_path, monkeypatch, caplog):
    path, files = model
    downloads = Downloads(monkeypatch)
    corrupted = []

    def once(name, start, end, out):  # noqa: ANN001, ANN202
        if name == SHARD_2 and not corrupted:
            corrupted.append(start)
            return flip_first_byte(out)
        return None

    downloads.hook = once
    with caplog.at_level(logging.WARNING, logger=model_cache.__name__):
        local = local_model_dir(path, str(tmp_path), **FAST)
    assert read_dir(local) == files
    assert downloads.bytes_of(SHARD_2) == 2 * len(files[SHARD_2])  # fetched again, whole
    assert downloads.bytes_of(SHARD_1) == len(files[SHARD_1])
    assert "crc32c" in caplog.text and "fetching it again" in caplog.text


def test_an_object_that_never_matches_its_checksum_is_an_error(model, tmp_path, monkeypatch):
    path, _ = model
    downloads = Downloads(monkeypatch)
    downloads.hook = lambda name, start, end, out: flip_first_byte(out) if name == SHARD_1 else None
    with pytest.raises(ModelCacheError, match=rf"{SHARD_1}: crc32c .* twice"):
        local_model_dir(path, str(tmp_path), **FAST)
    local = model_cache.cache_path(path, str(tmp_path))
    assert SHARD_1 not in os.listdir(local)  # never published unverified
    assert SHARD_1 + ".partial" not in os.listdir(local)


def test_an_interrupted_download_resumes_without_refetching_complete_files(
    model, tmp_path, monkeypatch
):
    path, files = model
    downloads = Downloads(monkeypatch)

    def cut(name, start, end, out):  # noqa: ANN001, ANN202
        if name == SHARD_2 and start > 0:
            raise ConnectionError("connection reset (simulated)")
        return None

    downloads.hook = cut
    with pytest.raises(ConnectionError):
        local_model_dir(path, str(tmp_path), **FAST)
    local = model_cache.cache_path(path, str(tmp_path))
    names = set(os.listdir(local))
    assert SHARD_2 not in names and SHARD_2 + ".partial" in names  # unverified: not published
    assert SHARD_1 in names  # finished before the cut (its ranges were all under way)
    with open(os.path.join(local, MARKER_FILE)) as fh:
        complete = set(json.load(fh)["files"])
    assert complete == set(files) - {SHARD_2}

    downloads.reset()
    assert local_model_dir(path, str(tmp_path), **FAST) == local
    assert downloads.names() == {SHARD_2}
    assert read_dir(local) == files
    assert not [n for n in os.listdir(local) if n.endswith(".partial")]


def test_a_changed_or_removed_remote_object_is_followed(model, tmp_path, monkeypatch):
    path, files = model
    downloads = Downloads(monkeypatch)
    local = local_model_dir(path, str(tmp_path), **FAST)
    # replaced with the same sizes: only the generations tell
    files[SHARD_1] = bytes(b ^ 0x5A for b in files[SHARD_1])
    files["config.json"] = files["config.json"].replace(b'"hidden_size": 8', b'"hidden_size": 9')
    for name in ("config.json", SHARD_1):
        storage.write_bytes(storage.join(path, name), files[name])
    storage.delete_prefix(storage.join(path, "tokenizer.json"))
    del files["tokenizer.json"]

    downloads.reset()
    assert local_model_dir(path, str(tmp_path), **FAST) == local
    assert downloads.names() == {"config.json", SHARD_1}
    assert read_dir(local) == files  # tokenizer.json is gone locally too


def test_two_callers_at_once_download_once(model, tmp_path, monkeypatch):
    path, files = model
    downloads = Downloads(monkeypatch)
    second_waits = threading.Event()

    class Waiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("waiting for another process"):
                second_waits.set()

    handler = Waiting()
    cache_log = logging.getLogger(model_cache.__name__)
    cache_log.addHandler(handler)
    cache_log.setLevel(logging.INFO)
    first_started = threading.Event()

    def hold_first(name, start, end, out):  # noqa: ANN001, ANN202
        if not first_started.is_set():
            first_started.set()
            second_waits.wait(timeout=5.0)  # both callers inside: one must wait for the other
        return None

    downloads.hook = hold_first
    results, errors = [], []

    def call() -> None:
        try:
            results.append(local_model_dir(path, str(tmp_path), **FAST))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        first = threading.Thread(target=call)
        first.start()
        assert first_started.wait(timeout=10.0)
        second = threading.Thread(target=call)
        second.start()
        first.join(timeout=30.0)
        second.join(timeout=30.0)
    finally:
        cache_log.removeHandler(handler)
        cache_log.setLevel(logging.NOTSET)
    assert errors == [] and len(results) == 2 and results[0] == results[1]
    assert second_waits.is_set()
    for name, data in files.items():
        assert downloads.bytes_of(name) == len(data), name  # each byte fetched once
    assert read_dir(results[0]) == files


def test_tokenizer_only_then_weights(chat_model_dir, gcs_bucket, tmp_path, monkeypatch):
    from rlax_tasks.data import PromptRenderer, PromptSettings

    path = storage.join(gcs_bucket, "chat-model")
    for name in os.listdir(chat_model_dir):
        with open(os.path.join(chat_model_dir, name), "rb") as fh:
            storage.write_bytes(storage.join(path, name), fh.read())
    monkeypatch.setenv(model_cache.CACHE_ENV, str(tmp_path))
    downloads = Downloads(monkeypatch)
    # the controller's route: a gs:// model.path renders prompts with its tokenizer, no weights
    remote = PromptRenderer.for_model(PromptSettings(template="chat"), path)
    local = PromptRenderer.for_model(PromptSettings(template="chat"), chat_model_dir)
    assert remote.encode("What is 2 + 2?") == local.encode("What is 2 + 2?")
    assert downloads.names() and not any(n.endswith(".safetensors") for n in downloads.names())

    downloads.reset()
    copy = local_model_dir(path)  # what load_pretrained asks for: the weights now
    assert downloads.names() == {
        n for n in os.listdir(chat_model_dir) if n.endswith(".safetensors")
    }
    assert read_dir(copy) == read_dir(chat_model_dir)
