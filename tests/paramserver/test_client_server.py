"""Push / pull over HTTP: round trips, shardings, concurrency, auth, corruption, GC, timeouts."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from rlax_tasks.models import Policy, make_mesh
from rlax_tasks.paramserver import (
    AuthenticationError,
    CorruptedWeightsError,
    ParameterServerError,
    PullTimeoutError,
    ServerUnavailableError,
    VersionConflictError,
)
from rlax_tasks.paramserver.wire import ArraySpec, Manifest, block_header_size
from tests.paramserver.helpers import TOKEN, CorruptingProxy
from tests.tiny_model import tiny_model_config

TINY = tiny_model_config(model_type="qwen3", qkv_bias=False)


def _params(version: int, n: int = 3, rows: int = 64) -> dict[str, np.ndarray]:
    """Arrays whose every element encodes the version: a mix of versions is visible."""
    return {f"w{i}": np.full((rows, 256), version * 10 + i, np.float32) for i in range(n)}


def _check(version: int, arrays: dict) -> None:
    for i in range(len(arrays)):
        a = np.asarray(arrays[f"w{i}"])
        assert (a == version * 10 + i).all(), f"w{i} of version {version} is mixed"


def test_policy_round_trip_sharded_push_into_target_sharding(server, client_for):
    base = Policy.init(TINY, seed=3)
    trainer_policy = base.shard(make_mesh(data=1, fsdp=4, tensor=2))
    trainer = client_for(server.address, chunk_bytes=1024)
    trainer.push(1, trainer_policy.params)  # shard by shard, never gathered

    # a worker with another layout: arrays go straight to its shardings
    worker_params = Policy.init(TINY, seed=9).shard(make_mesh(data=1, fsdp=2, tensor=4)).params
    worker = client_for(server.address, worker_id="w0")
    version, params = worker.pull(like=worker_params)
    assert version == 1
    for leaf, ref in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(worker_params), strict=True
    ):
        assert leaf.sharding == ref.sharding
    pulled = Policy(TINY, base.graphdef, params).named_params()
    for (name, got), (_, want) in zip(pulled, base.named_params(), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)

    # into an unsharded template: Policy.with_params gives the trainer's function
    fresh = Policy.init(TINY, seed=9)
    _, params = worker.pull(like=fresh.params)
    ids = np.array([[1, 5, 7, 9, 11]])
    np.testing.assert_array_equal(
        np.asarray(fresh.with_params(params).logits(ids)), np.asarray(base.logits(ids))
    )
    # default: a dict of host arrays named like Policy.named_params()
    _, named = worker.pull()
    assert list(named) == [n for n, _ in base.named_params()]
    assert all(isinstance(a, np.ndarray) for a in named.values())


def test_explicit_shardings_dtypes_scalars_and_empty_arrays(server, client_for):
    mesh = make_mesh(data=1, fsdp=8, tensor=1)
    tree = {
        "emb": jnp.arange(64 * 8, dtype=jnp.bfloat16).reshape(64, 8),
        "scale": jnp.float32(2.5),
        "empty": jnp.zeros((0, 4), jnp.int32),
        "nested": {"b": np.arange(10, dtype=np.int64)},
    }
    c = client_for(server.address)
    c.push(5, tree)
    sh = NamedSharding(mesh, P("fsdp"))
    version, got = c.pull(shardings={"emb": sh})
    assert version == 5
    assert got["emb"].dtype == jnp.bfloat16 and got["emb"].sharding == sh
    np.testing.assert_array_equal(np.asarray(got["emb"]), np.asarray(tree["emb"]))
    assert got["scale"].shape == () and float(got["scale"]) == 2.5
    assert got["empty"].shape == (0, 4)
    np.testing.assert_array_equal(got["nested.b"], np.arange(10))
    with pytest.raises(ValueError, match="lacks"):
        c.pull(shardings={"nope": sh})


def test_versions_strictly_increase_and_pull_waits_with_a_timeout(server, client_for, monkeypatch):
    c = client_for(server.address)
    assert c.latest_version() is None
    with pytest.raises(PullTimeoutError):
        c.pull(timeout_s=0.3)
    c.push(2, _params(2))
    with pytest.raises(VersionConflictError):
        c.push(2, _params(2))
    with pytest.raises(VersionConflictError):
        c.push(1, _params(1))

    waiting = threading.Event()  # set when the server starts waiting for the pull's version
    wait_for = server.store.wait_for

    def spy(min_version: int | None, timeout_s: float):  # noqa: ANN202
        waiting.set()
        return wait_for(min_version, timeout_s)

    monkeypatch.setattr(server.store, "wait_for", spy)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(r=c.pull(min_version=3, timeout_s=10)))
    waiter.start()
    assert waiting.wait(10)  # the pull reached the server, which holds 2 only: it waits
    c.push(3, _params(3))
    waiter.join(timeout=10)
    version, arrays = got["r"]  # the waiting pull got the version pushed after it
    assert version == 3
    _check(3, arrays)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared-memory", "tcp"])
def test_trainer_pushes_while_four_workers_pull(make_server, client_for, shared_memory):
    """Versions recycle the shared memory of collected ones while workers read: every pull is
    one whole version, never mixed with another."""
    server = make_server(keep_versions=2)
    last = 8
    trainer = client_for(server.address, chunk_bytes=16 * 1024)
    seen: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def work(wid: str) -> None:
        c = client_for(
            server.address, worker_id=wid, chunk_bytes=16 * 1024, shared_memory=shared_memory
        )
        try:
            c.register()
            v = 0
            while v < last:
                v, arrays = c.pull(min_version=v + 1, timeout_s=30)
                _check(v, arrays)  # complete and not mixed with another version
                seen.setdefault(wid, []).append(v)
                c.ack(v)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for v in range(1, last + 1):
        trainer.push(v, _params(v, rows=512))
        time.sleep(0.02)
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert sorted(seen) == ["w0", "w1", "w2", "w3"]
    for versions in seen.values():
        assert versions == sorted(set(versions)) and versions[-1] == last
    # every worker acked the last version: only the newest keep_versions remain
    assert server.store.versions() == [last - 1, last]


def _raw(address: str, method: str, path: str, headers: dict, body: bytes = b"") -> tuple:
    url = urllib.parse.urlsplit(address)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("WWW-Authenticate")
    finally:
        conn.close()


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/v1/latest"),
        ("GET", "/v1/status"),
        ("GET", "/v1/pull?wait_s=0"),
        ("GET", "/v1/versions/1"),
        ("PUT", "/v1/versions/9"),
        ("POST", "/v1/workers/w0/ack"),
        ("DELETE", "/v1/workers/w0"),
    ],
)
def test_missing_token_is_401_and_wrong_token_is_403(server, client_for, method, path):
    client_for(server.address).push(1, _params(1))
    status, body, challenge = _raw(server.address, method, path, {})
    assert status == 401 and challenge.startswith("Bearer")
    status, _, _ = _raw(server.address, method, path, {"Authorization": "Basic abc"})
    assert status == 401
    status, body, _ = _raw(server.address, method, path, {"Authorization": "Bearer wrong"})
    assert status == 403 and b"wrong bearer token" in body
    status, _, _ = _raw(server.address, "GET", "/v1/latest", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200


def test_client_with_a_wrong_token_raises_and_pushes_nothing(server, client_for):
    bad = client_for(server.address, token="not-the-token")
    with pytest.raises(AuthenticationError, match="403"):
        bad.latest_version()
    with pytest.raises(AuthenticationError):
        bad.push(1, _params(1))
    with pytest.raises(AuthenticationError):
        bad.pull(timeout_s=1)
    assert server.store.latest_version() is None


def _mid_block_offset(chunk: int, http_head: int = 300) -> int:
    """A response offset well inside the data of the 3rd block of one 1-D float32 array
    (``http_head``: about the bytes of the HTTP status line or request line and headers)."""
    head = len(Manifest(1, (ArraySpec("w", "float32", (1 << 18,)),), 16).encode())
    block = block_header_size(1)
    return http_head + head + 2 * (block + chunk) + block + chunk // 2


def test_corrupted_chunk_is_detected_and_the_pull_retried(server, client_for, caplog):
    chunk = 64 * 1024
    data = {"w": np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32)}
    client_for(server.address, chunk_bytes=chunk).push(1, data)
    proxy = CorruptingProxy(int(server.address.rsplit(":", 1)[1]), _mid_block_offset(chunk), 1)
    try:
        worker = client_for(proxy.url, worker_id="w0", retries=2, shared_memory=False)
        with caplog.at_level(logging.WARNING, "rlax_tasks.paramserver.client"):
            version, got = worker.pull()
        assert proxy.corrupted == 1
        assert "block 2 of array 'w' fails its CRC32C" in caplog.text
        np.testing.assert_array_equal(got["w"], data["w"])
    finally:
        proxy.close()


def test_persistent_corruption_is_a_clear_error(server, client_for):
    chunk = 64 * 1024
    data = {"w": np.ones(1 << 18, np.float32)}
    client_for(server.address, chunk_bytes=chunk).push(1, data)
    proxy = CorruptingProxy(int(server.address.rsplit(":", 1)[1]), _mid_block_offset(chunk), 99)
    try:
        worker = client_for(proxy.url, retries=2, shared_memory=False)
        with pytest.raises(
            CorruptedWeightsError, match="3 times.*block 2 of array 'w' fails its CRC32C"
        ):
            worker.pull()
        assert proxy.corrupted == 3
    finally:
        proxy.close()


@pytest.mark.parametrize("verify_push", [True, False], ids=["verified", "unverified"])
def test_a_push_corrupted_in_transit_is_refused_and_never_served(
    make_server, client_for, verify_push
):
    """One byte flipped in a pushed block's payload on its way to the server: the server refuses
    the version (422 naming the block) and keeps serving the previous one. With the server's
    check off (--no-verify-push) the version is stored, but no worker ever uses it: every pull
    fails its CRC32C."""
    server = make_server(verify_push=verify_push)
    chunk = 64 * 1024
    good = {"w": np.arange(1 << 18, dtype=np.float32)}
    client_for(server.address, chunk_bytes=chunk).push(1, good)
    port = int(server.address.rsplit(":", 1)[1])
    proxy = CorruptingProxy(port, _mid_block_offset(chunk, http_head=200), 1, requests=True)
    try:
        trainer = client_for(proxy.url, chunk_bytes=chunk, retries=0)
        bad = {"w": good["w"] + 1}
        worker = client_for(server.address, retries=1)
        if verify_push:
            with pytest.raises(ParameterServerError, match="HTTP 422") as err:
                trainer.push(2, bad)
            assert "block 2 (array 'w') fails its CRC32C" in str(err.value)
            assert proxy.corrupted == 1 and server.store.versions() == [1]
            version, got = worker.pull()
            assert version == 1
            np.testing.assert_array_equal(got["w"], good["w"])
            trainer.push(2, bad)  # the same version, sent intact, goes through
            assert worker.pull()[0] == 2
        else:
            trainer.push(2, bad)
            assert proxy.corrupted == 1 and server.store.latest_version() == 2
            with pytest.raises(
                CorruptedWeightsError, match="block 2 of array 'w' fails its CRC32C"
            ):
                worker.pull()
    finally:
        proxy.close()


def test_gc_rule_over_http(make_server, client_for):
    server = make_server(keep_versions=1)
    trainer = client_for(server.address)
    a = client_for(server.address, worker_id="a")
    b = client_for(server.address, worker_id="b")
    trainer.push(1, _params(1))
    a.register()
    b.register()
    trainer.push(2, _params(2))
    assert server.store.versions() == [1, 2]  # registered workers that acked nothing hold all
    for w in (a, b):
        v, _ = w.pull()
        w.ack(v)
    assert server.store.versions() == [2]
    trainer.push(3, _params(3))
    trainer.push(4, _params(4))
    assert server.store.versions() == [2, 3, 4]  # both still run version 2
    a.ack(4)
    assert server.store.versions() == [2, 3, 4]
    v, arrays = b.pull_version(3)
    _check(3, arrays)
    b.ack(3)
    assert server.store.versions() == [3, 4]
    b.deregister()
    assert server.store.versions() == [4]
    with pytest.raises(ParameterServerError, match="404"):
        a.pull_version(3)
    assert trainer.status()["workers"].keys() == {"a"}


def test_a_worker_that_disappears_stops_holding_versions(make_server, client_for):
    server = make_server(keep_versions=1, worker_timeout_s=0.6)
    trainer = client_for(server.address)
    alive = client_for(server.address, worker_id="alive")
    ghost = client_for(server.address, worker_id="ghost")
    trainer.push(1, _params(1))
    for w in (alive, ghost):
        w.ack(w.pull()[0])
    alive.start_heartbeats(0.1)
    trainer.push(2, _params(2))
    alive.ack(2)
    assert server.store.versions() == [1, 2]  # the ghost still holds 1
    deadline = time.monotonic() + 5
    while server.store.versions() != [2] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.store.versions() == [2]
    assert set(server.store.workers()) == {"alive"}  # heartbeats kept it registered


def test_half_finished_push_is_discarded_after_the_io_timeout(make_server, client_for):
    server = make_server(io_timeout_s=0.5)
    url = urllib.parse.urlsplit(server.address)
    man = Manifest(1, (ArraySpec("w", "float32", (1024,)),), 1).encode()
    sock = socket.create_connection((url.hostname, url.port))
    sock.sendall(
        b"PUT /v1/versions/1 HTTP/1.1\r\nHost: x\r\n"
        + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(man) + 4000}\r\n\r\n".encode()
        + man
        + b"RXB2"
    )
    sock.settimeout(10)  # far above io_timeout_s: a server that waits on fails the test
    assert sock.recv(1024) == b""  # the trainer stalled: the server gave up and closed
    sock.close()
    assert server.store.latest_version() is None
    c = client_for(server.address)
    c.push(1, _params(1))  # the version number is free again
    _check(1, c.pull()[1])


def test_a_dead_or_stalled_server_never_hangs_the_client(client_for):
    # a socket that accepts connections (kernel backlog) but never answers
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(8)
    port = stalled.getsockname()[1]
    try:
        c = client_for(f"http://127.0.0.1:{port}", timeout_s=0.3, retries=1)
        t0 = time.monotonic()
        with pytest.raises(ServerUnavailableError):
            c.latest_version()
        with pytest.raises(ServerUnavailableError):
            c.pull(timeout_s=0.2)
        with pytest.raises(ServerUnavailableError):
            c.pull_version(1)
        assert time.monotonic() - t0 < 5
    finally:
        stalled.close()
    dead = client_for(f"http://127.0.0.1:{port}", timeout_s=0.3, retries=0)
    with pytest.raises(ServerUnavailableError):
        dead.push(1, _params(1))
    with pytest.raises(ServerUnavailableError):
        dead.pull_version(1)  # connection refused


def test_status_and_input_validation(server, client_for):
    with pytest.raises(ValueError, match="url"):
        client_for("localhost:80")
    with pytest.raises(ValueError, match="token"):
        client_for(server.address, token="")
    c = client_for(server.address)
    with pytest.raises(ValueError, match="worker_id"):
        c.ack(1)
    with pytest.raises(ValueError, match="version"):
        c.push(-1, _params(1))
    c.push(1, _params(1))
    status = c.status()
    assert status["latest"] == 1 and status["versions"] == [1]
    status_code, body, _ = _raw(
        server.address,
        "POST",
        "/v1/workers/w0/ack",
        {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        json.dumps({"version": 5}).encode(),
    )
    assert status_code == 400 and b"cannot ack version 5" in body
