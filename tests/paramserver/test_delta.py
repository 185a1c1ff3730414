"""Delta pulls (docs/design.md §6): a worker that holds a version receives only the elements that
changed, ends bit-identical to a full pull, and falls back to a full pull when its base is gone, the
arrays changed, or a delta block arrives corrupted."""

from __future__ import annotations

import http.client
import json
import logging
import urllib.parse

import jax
import ml_dtypes
import numpy as np
import pytest

from rlax_tasks.paramserver.delta import PAGE, apply_sparse, sparse_payload
from rlax_tasks.paramserver.wire import WireError
from tests.paramserver.helpers import CorruptingProxy

BF16 = ml_dtypes.bfloat16


def _params(seed: int = 0) -> dict[str, np.ndarray]:
    """bf16 weights of a small model's scale (a few blocks each at a 64 KiB chunk)."""
    rng = np.random.default_rng(seed)
    return {
        "embed": (rng.standard_normal((512, 96)) * 0.02).astype(BF16),
        "mlp": (rng.standard_normal((96, 1024)) * 0.02).astype(BF16),
        "norm": np.ones(96, BF16),
    }


def _adam_step(master: dict[str, np.ndarray], seed: int, lr: float = 1e-6) -> dict:
    """One Adam step's size from the float32 master weights (|update| = lr, Adam's first step),
    in place; the bf16 weights the workers run. ``norm`` gets no gradient."""
    rng = np.random.default_rng(seed)
    for name, w in master.items():
        if name != "norm":
            w -= lr * np.sign(rng.standard_normal(w.shape)).astype(np.float32)
    return {name: w.astype(BF16) for name, w in master.items()}


def _assert_bitwise(got: dict, want: dict) -> None:
    for name, w in want.items():
        got_w = np.asarray(got[name])
        assert got_w.dtype == w.dtype, name
        np.testing.assert_array_equal(got_w.view(np.uint16), w.view(np.uint16), err_msg=name)


# --------------------------------------------------------------------------- encoding
@pytest.mark.parametrize("dtype", [BF16, np.float32, np.int8])
def test_a_sparse_payload_rebuilds_the_new_bytes_across_pages(dtype):
    rng = np.random.default_rng(1)
    n = 3 * PAGE + 17  # four pages, the last one short
    old = rng.standard_normal(n).astype(dtype)
    new = old.copy()
    changed = np.unique(np.r_[0, PAGE - 1, PAGE, 3 * PAGE + 16, rng.integers(0, n, 500)])
    new[changed] = (rng.standard_normal(changed.size) + 5).astype(dtype)
    old_b, new_b = old.view(np.uint8), new.view(np.uint8)
    payload = sparse_payload(old_b, new_b, old.itemsize)
    assert payload is not None
    differ = int((old.view(f"u{old.itemsize}") != new.view(f"u{old.itemsize}")).sum())
    assert len(payload) == 4 * 4 + differ * (2 + old.itemsize)
    region = old_b.copy()
    apply_sparse(region, np.frombuffer(payload, np.uint8), old.itemsize)
    np.testing.assert_array_equal(region, new_b)


def test_a_change_of_sign_bit_or_nan_payload_counts_as_changed():
    old = np.ones(100, np.float32)
    old[:2] = [0.0, np.nan]
    new = old.copy()
    new[0] = -0.0  # equal to 0.0 as a float
    new.view(np.uint32)[1] |= 1  # another NaN's bits
    payload = sparse_payload(old.view(np.uint8), new.view(np.uint8), 4)
    assert len(payload) == 4 + 2 * (2 + 4)
    region = old.view(np.uint8).copy()
    apply_sparse(region, np.frombuffer(payload, np.uint8), 4)
    np.testing.assert_array_equal(region, new.view(np.uint8))


def test_a_dense_change_is_not_sent_sparse_and_a_bad_payload_is_refused():
    old = np.zeros(1000, np.float32).view(np.uint8)
    assert sparse_payload(old, np.ones(1000, np.float32).view(np.uint8), 4) is None
    new = old.copy()
    new[:4] = 1
    payload = np.frombuffer(sparse_payload(old, new, 4), np.uint8)
    with pytest.raises(WireError, match="does not hold"):
        apply_sparse(old.copy(), payload[:-1], 4)
    bad = payload.copy()
    bad[4:6] = 0xFF  # position 65535 of a 1000-element region
    with pytest.raises(WireError, match="changes element 65535 of 1000"):
        apply_sparse(old.copy(), bad, 4)


# --------------------------------------------------------------------------- pulls
def _trainer_and_worker(make_server, client_for, **server):
    ps = make_server(keep_versions=4, **server)
    trainer = client_for(ps.address, chunk_bytes=64 * 1024)
    worker = client_for(ps.address, worker_id="w0", shared_memory=False)
    worker.register()
    return ps, trainer, worker


def test_a_worker_pulls_only_what_changed_and_ends_bit_identical(make_server, client_for):
    ps, trainer, worker = _trainer_and_worker(make_server, client_for)
    master = {k: v.astype(np.float32) for k, v in _params().items()}
    v1 = {k: v.astype(BF16) for k, v in master.items()}
    trainer.push(1, v1)
    _, got = worker.pull()
    assert worker.last_pull.base is None and worker.last_pull.nbytes == worker.last_pull.full_nbytes
    _assert_bitwise(got, v1)
    worker.ack(1)
    for version in (2, 3):
        want = _adam_step(master, seed=version)
        trainer.push(version, want)
        _, got = worker.pull(min_version=version)
        stats = worker.last_pull
        assert (stats.version, stats.base) == (version, version - 1)
        assert stats.nbytes <= 0.10 * stats.full_nbytes, stats
        _assert_bitwise(got, want)
        fresh = client_for(ps.address, shared_memory=False).pull(min_version=version)[1]
        _assert_bitwise(fresh, want)  # what a full pull of the same version gives
        worker.ack(version)


def test_a_worker_that_skipped_versions_gets_one_delta_from_what_it_holds(make_server, client_for):
    _, trainer, worker = _trainer_and_worker(make_server, client_for)
    master = {k: v.astype(np.float32) for k, v in _params().items()}
    trainer.push(1, {k: v.astype(BF16) for k, v in master.items()})
    worker.pull()
    worker.ack(1)
    for version in (2, 3, 4):
        want = _adam_step(master, seed=version)
        trainer.push(version, want)
    _, got = worker.pull(min_version=4)
    assert (worker.last_pull.version, worker.last_pull.base) == (4, 1)
    _assert_bitwise(got, want)


def test_without_its_base_or_with_new_arrays_a_worker_pulls_the_whole_version(
    make_server, client_for
):
    ps, trainer, worker = _trainer_and_worker(make_server, client_for)
    master = {k: v.astype(np.float32) for k, v in _params().items()}
    trainer.push(1, {k: v.astype(BF16) for k, v in master.items()})
    worker.pull()
    worker.deregister()  # holds nothing the server keeps for it: version 1 may go
    for version in range(2, 7):
        want = _adam_step(master, seed=version)
        trainer.push(version, want)
    assert 1 not in ps.store.versions()
    _, got = worker.pull(min_version=6)
    assert worker.last_pull.base is None
    _assert_bitwise(got, want)
    grown = {**want, "norm": np.ones(128, BF16)}  # another shape: a delta cannot rebuild it
    trainer.push(7, grown)
    _, got = worker.pull(min_version=7)
    assert worker.last_pull.base is None
    _assert_bitwise(got, grown)


def test_a_corrupted_delta_block_falls_back_to_a_full_pull(make_server, client_for, caplog):
    ps = make_server(keep_versions=4)
    trainer = client_for(ps.address, chunk_bytes=1 << 20)
    proxy = CorruptingProxy(int(ps.address.rsplit(":", 1)[1]), offset=20_000, count=0)
    try:
        worker = client_for(proxy.url, worker_id="w0", shared_memory=False, retries=2)
        rng = np.random.default_rng(3)
        v1 = {"w": rng.standard_normal(1 << 18).astype(BF16)}  # one block of 512 KiB
        trainer.push(1, v1)
        worker.pull()
        v2 = {"w": v1["w"].copy()}
        v2["w"][rng.integers(0, 1 << 18, 13_000)] += BF16(1.0)  # ~52 KB of sparse payload
        trainer.push(2, v2)
        proxy.remaining = 1  # the byte at 20,000 of the delta reply: inside its payload
        with caplog.at_level(logging.WARNING, "rlax_tasks.paramserver.client"):
            _, got = worker.pull(min_version=2)
        assert proxy.corrupted == 1
        assert "fails its CRC32C" in caplog.text and "pulling again" in caplog.text
        assert worker.last_pull.base is None  # the retry took the whole version
        _assert_bitwise(got, v2)
    finally:
        proxy.close()


def test_placed_arrays_never_share_memory_with_the_held_copy(make_server, client_for):
    """The delta rebuilds the held copy in place: an array an earlier pull returned (placed on
    a JAX device, or on the host) keeps its version."""
    _, trainer, worker = _trainer_and_worker(make_server, client_for)
    master = {k: v.astype(np.float32) for k, v in _params().items()}
    v1 = {k: v.astype(BF16) for k, v in master.items()}
    trainer.push(1, v1)
    like = jax.tree.map(jax.numpy.asarray, v1)
    _, placed_1 = worker.pull(like=like)
    _, host_1 = worker.pull_version(1)  # the version it holds: every block unchanged
    assert worker.last_pull.base == 1 and worker.last_pull.nbytes < 1000
    v2 = _adam_step(master, seed=2)
    trainer.push(2, v2)
    _, placed_2 = worker.pull(min_version=2, like=like)
    assert worker.last_pull.base == 1
    _assert_bitwise(placed_1, v1)
    _assert_bitwise(host_1, v1)
    _assert_bitwise(placed_2, v2)


def test_the_server_sends_a_delta_only_from_the_content_the_worker_holds(server, client_for):
    """``have`` names a version and ``have_digest`` its content: a worker whose version 1 is
    another content (a server that restarted without its mirror) gets the whole version."""
    from rlax_tasks.paramserver.protocol import DELTA_TYPE
    from tests.paramserver.helpers import TOKEN

    host, port = urllib.parse.urlsplit(server.address).netloc.split(":")

    def get(path: str) -> tuple[str, bytes]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", path, headers={"Authorization": f"Bearer {TOKEN}"})
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
        assert resp.status == 200, body[:200]
        return resp.getheader("Content-Type"), body

    trainer = client_for(server.address)
    master = {k: v.astype(np.float32) for k, v in _params().items()}
    trainer.push(1, {k: v.astype(BF16) for k, v in master.items()})
    digest = json.loads(get("/v1/latest")[1])["digest"]
    trainer.push(2, _adam_step(master, seed=2))
    assert get(f"/v1/versions/2?have=1&have_digest={digest}")[0] == DELTA_TYPE
    whole = "application/octet-stream"
    assert get(f"/v1/versions/2?have=1&have_digest={'0' * 64}")[0] == whole
    assert get(f"/v1/versions/2?have=7&have_digest={digest}")[0] == whole
