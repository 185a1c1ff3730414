"""Parameter-server replicas (docs/design.md §16): relays, failover, collection that waits for
every live replica, a corrupted replica skipped, a link limit."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from rlax_tasks.paramserver import ParameterServer, ParameterServerClient, ServerConfig
from rlax_tasks.paramserver.assignment import assign_replica, failover_order
from rlax_tasks.paramserver.replicas import ReplicaClient
from tests.paramserver.helpers import TOKEN, CorruptingProxy, start_server_process


def _params(version: int, n: int = 4096) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {"w": rng.standard_normal(n).astype(np.float32), "b": np.full(8, version, np.float32)}


def _wait(predicate, timeout_s: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def fleet(make_server):
    """start(upstreams=..., **config) -> a started server (no mirror); all stopped at the end."""
    return lambda **kw: make_server(**{"run_root": None, **kw})


def _replicas(fleet, n: int, relay: str = "star", **kw) -> list[ParameterServer]:
    primary = fleet(**kw)
    out = [primary]
    for r in range(1, n):
        ups = (
            (primary.address,) if relay == "star" or r == 1 else (out[-1].address, primary.address)
        )
        out.append(fleet(upstreams=ups, replica_id=f"ps-{r}", **kw))
    return out


def test_assignment_is_even_and_failover_spreads_a_dead_replicas_workers():
    homes = [assign_replica(i, 3) for i in range(10)]
    assert sorted(homes.count(r) for r in range(3)) == [3, 3, 4]
    assert failover_order(1, 3) == [1, 2, 0]
    # the workers of replica 1 (indices 1, 4, 7, 10 of 3 replicas) move to 2 and 0 in turn
    assert [failover_order(1, 3, i)[1] for i in (1, 4, 7, 10)] == [2, 0, 2, 0]
    assert failover_order(0, 1, 5) == [0]
    with pytest.raises(ValueError, match="replicas"):
        assign_replica(0, 0)


@pytest.mark.parametrize("relay", ["star", "chain"])
def test_every_replica_reaches_every_version_with_the_same_digest(fleet, relay):
    servers = _replicas(fleet, 3, relay)
    pusher = ParameterServerClient(servers[0].address, token=TOKEN)
    for v in (1, 2, 3):
        pusher.push(v, _params(v))
        for s in servers:
            _wait(lambda s=s, v=v: s.store.latest_version() == v, what=f"v{v} on {s.address}")
        digests = {s.store.latest().digest for s in servers}
        assert len(digests) == 1  # the relayed stream is the pushed one, byte for byte
    for s in servers[1:]:
        assert s.status()["replica"]["relayed"] == 3
    # workers spread over the replicas pull the same arrays from each
    urls = [s.address for s in servers]
    for i in range(3):
        home = assign_replica(i, 3)
        order = failover_order(home, 3)
        with ReplicaClient([urls[r] for r in order], 0, TOKEN, worker_id=f"w{i}") as c:
            c.register()
            version, arrays = c.pull(3)
            assert version == 3 and c.current == urls[home]
            np.testing.assert_array_equal(arrays["w"], _params(3)["w"])


def test_collection_waits_for_every_live_replica(fleet, tmp_path):
    primary = fleet(keep_versions=1, worker_timeout_s=1.5)
    # a replica in a process of its own (`rlax ps serve --upstream`), killed with SIGKILL below
    proc, url = start_server_process(
        str(tmp_path / "replica"), "--upstream", primary.address, "--replica-id", "ps-1"
    )
    try:
        pusher = ParameterServerClient(primary.address, token=TOKEN)
        pusher.push(1, _params(1))
        _wait(lambda: primary.store.workers().get("ps-1", {}).get("acked") == 1, what="ps-1 ack")
        assert ParameterServerClient(url, token=TOKEN).latest_version() == 1
        proc.kill()  # no deregistration: live until it times out
        proc.wait()
        pusher.push(2, _params(2))
        pusher.push(3, _params(3))
        # beyond keep_versions=1, every version from v1 on is kept: ps-1 confirmed nothing newer
        assert primary.store.versions() == [1, 2, 3]
    finally:
        proc.kill()
        proc.wait()
    _wait(lambda: "ps-1" not in primary.store.workers(), what="ps-1 timing out")
    assert primary.store.versions() == [3]  # no live replica holds v1 any more


def test_a_worker_fails_over_when_its_replica_dies_and_returns_when_it_is_back(fleet):
    servers = _replicas(fleet, 3)
    pusher = ParameterServerClient(servers[0].address, token=TOKEN)
    pusher.push(1, _params(1))
    urls = [s.address for s in servers]
    for s in servers:
        _wait(lambda s=s: s.store.latest_version() == 1, what="v1 everywhere")
    c = ReplicaClient([urls[1], urls[2], urls[0]], 0, TOKEN, worker_id="w1", home_retry_s=0.0,
                      timeout_s=2.0, retries=1)  # fmt: skip
    c.register()
    assert c.pull(1)[0] == 1 and c.current == urls[1]
    c.ack(1)
    port = int(urls[1].rsplit(":", 1)[1])
    servers[1].stop()
    pusher.push(2, _params(2))
    version, arrays = c.pull(2)
    assert version == 2 and c.current == urls[2] and c.failovers == 1
    np.testing.assert_array_equal(arrays["w"], _params(2)["w"])
    assert "w1" in servers[2].store.workers()  # registered where it pulls now
    back = fleet(port=port, upstreams=(urls[0],), replica_id="ps-1")
    _wait(lambda: back.store.latest_version() == 2, what="the restarted replica relaying v2")
    assert c.pull(2)[0] == 2 and c.current == urls[1]  # home again
    assert "w1" in back.store.workers() and "w1" not in servers[2].store.workers()
    c.close()


def test_a_replica_that_sends_corrupted_weights_is_skipped(fleet):
    servers = _replicas(fleet, 2)
    pusher = ParameterServerClient(servers[0].address, token=TOKEN)
    pusher.push(1, _params(1))
    _wait(lambda: servers[1].store.latest_version() == 1, what="v1 on ps-1")
    proxy = CorruptingProxy(int(servers[1].address.rsplit(":", 1)[1]), offset=2000, count=100)
    try:
        c = ReplicaClient([proxy.url, servers[0].address], 0, TOKEN, worker_id="w",
                          retries=1, delta=False, shared_memory=False)  # fmt: skip
        version, arrays = c.pull(1)
        assert version == 1 and c.current == servers[0].address
        np.testing.assert_array_equal(arrays["w"], _params(1)["w"])
        c.close()
    finally:
        proxy.close()


def test_a_relay_skips_an_upstream_that_sends_a_corrupted_version(fleet):
    primary = fleet()
    proxy = CorruptingProxy(int(primary.address.rsplit(":", 1)[1]), offset=2000, count=100)
    try:
        replica = fleet(upstreams=(proxy.url, primary.address), replica_id="ps-1")
        ParameterServerClient(primary.address, token=TOKEN).push(1, _params(1))
        _wait(lambda: replica.store.latest_version() == 1, what="v1 relayed past the proxy")
        assert replica.relay.skipped.get(proxy.url, 0) >= 1
        assert replica.store.latest().digest == primary.store.latest().digest
    finally:
        proxy.close()


def test_a_replica_needs_an_id_and_the_link_limit_paces_a_pull(fleet):
    with pytest.raises(ValueError, match="replica_id"):
        ServerConfig(token=TOKEN, upstreams=("http://127.0.0.1:1",))
    with pytest.raises(ValueError, match="egress_bytes_per_s"):
        ServerConfig(token=TOKEN, egress_bytes_per_s=0)
    slow = fleet(egress_bytes_per_s=2_000_000)
    ParameterServerClient(slow.address, token=TOKEN).push(1, _params(1, n=500_000))  # 2 MB
    puller = ParameterServerClient(slow.address, token=TOKEN, shared_memory=False, delta=False)
    t0 = time.monotonic()
    puller.pull(1)
    took = time.monotonic() - t0
    assert took >= 0.8, took  # 2 MB at 2 MB/s, less the bucket's first burst


def test_a_relay_stream_goes_before_the_workers_on_a_limited_link():
    from rlax_tasks.paramserver.egress import TokenBucket

    bucket = TokenBucket(1e9)
    taken: list[str] = []
    with bucket.first():
        waiter = threading.Thread(target=lambda: (bucket.take(10), taken.append("worker")))
        waiter.start()
        time.sleep(0.2)
        assert taken == []  # a worker's bytes wait while the relay's stream sends
        bucket.take(10, first=True)
        taken.append("relay")
    waiter.join(timeout=5)
    assert taken == ["relay", "worker"]


def test_replicas_relay_first_then_serve_their_workers(fleet):
    """On replica 0's limited link, a relay pull that starts behind a worker's still finishes
    first (the worker's bytes wait while the relay's stream sends)."""
    primary = fleet(egress_bytes_per_s=4_000_000)
    ParameterServerClient(primary.address, token=TOKEN).push(1, _params(1, n=1_000_000))  # 4 MB
    done: dict[str, float] = {}

    def worker_pull():
        c = ParameterServerClient(primary.address, token=TOKEN, shared_memory=False, delta=False)
        c.pull(1)
        done["worker"] = time.monotonic()

    t = threading.Thread(target=worker_pull)
    t.start()
    time.sleep(0.2)  # the worker's pull is under way
    replica = fleet(upstreams=(primary.address,), replica_id="ps-1")
    _wait(lambda: replica.store.latest_version() == 1, what="the relay")
    done["relay"] = time.monotonic()
    t.join(timeout=30)
    assert done["relay"] < done["worker"], done
