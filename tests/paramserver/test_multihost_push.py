"""Multi-host pushes (docs/design.md §6): every trainer host pushes the blocks of its own shards as
one part of a version; the server commits the version once the last part arrives and the parts tile
every array, and abandons it (telling every waiting part why) when they do not."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import urllib.parse

import numpy as np
import pytest

from rlax_tasks.cli import build_parser
from rlax_tasks.paramserver import ParameterServerError, ServerConfig, VersionConflictError
from rlax_tasks.paramserver.protocol import PART_HEADER, PARTS_HEADER
from rlax_tasks.paramserver.wire import (
    ArraySpec,
    BlockHeader,
    Manifest,
    as_bytes,
    crc32c,
    end_frame,
    version_digest,
)
from tests.compute.helpers import wait_for
from tests.conftest import TEST_XLA_FLAGS
from tests.paramserver.helpers import TOKEN, free_port
from tests.paramserver.multihost_pusher import expected

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "multihost_pusher.py")
REPO = os.path.dirname(os.path.dirname(HERE))

W = np.arange(32, dtype=np.float32).reshape(4, 8)
B = np.arange(8, dtype=np.int32) * 7
UNIT = W.nbytes + B.nbytes  # bytes of one version of the hand-made parts


# --------------------------------------------------------------------------- hand-made parts
Region = tuple[str, tuple[int, ...], tuple[int, ...]]


def _stream(
    version: int,
    regions: list[Region],
    arrays: dict[str, np.ndarray] | None = None,
    corrupt: bool = False,
) -> bytes:
    """A push stream of ``regions`` of ``arrays`` (default w and b) under the manifest of them
    all; ``corrupt``: the last block's bytes no longer match its CRC32C."""
    arrays = {"w": W, "b": B} if arrays is None else arrays
    names = list(arrays)
    frames, headers = [], []
    for name, start, stop in regions:
        index = tuple(slice(a, b) for a, b in zip(start, stop, strict=True))
        data = bytearray(as_bytes(arrays[name][index]))
        header = BlockHeader(names.index(name), start, stop, len(data), crc32c(data))
        headers.append(header)
        if corrupt and len(headers) == len(regions):
            data[0] ^= 0xFF
        frames += [header.encode(), data]
    specs = tuple(ArraySpec(n, a.dtype.name, a.shape) for n, a in arrays.items())
    manifest = Manifest(version, specs, len(regions))
    digest = version_digest(manifest, headers)
    return manifest.encode() + b"".join(frames) + end_frame(len(headers), digest)


PART0 = [("w", (0, 0), (1, 8)), ("w", (1, 0), (2, 8)), ("b", (0,), (8,))]  # rows 0-1 of w, b
PART1 = [("w", (2, 0), (4, 8))]  # rows 2-3 of w


def _request(address: str, method: str, path: str, body: bytes, headers: dict) -> tuple[int, dict]:
    url = urllib.parse.urlsplit(address)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request(
            method, path, body=body, headers={"Authorization": f"Bearer {TOKEN}", **headers}
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def _part_headers(part: int, parts: int) -> dict:
    return {PART_HEADER: str(part), PARTS_HEADER: str(parts)}


class _Host:
    """Sends parts as trainer hosts do: each PUT on its own thread (the reply is held until the
    version is decided); ``reply(future)`` is (status, JSON)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.pool = concurrent.futures.ThreadPoolExecutor(8)

    def put(self, version: int, part: int, parts: int, body: bytes) -> concurrent.futures.Future:
        headers = _part_headers(part, parts)
        return self.pool.submit(
            _request, self.address, "PUT", f"/v1/versions/{version}", body, headers
        )

    @staticmethod
    def reply(future: concurrent.futures.Future) -> tuple[int, dict]:
        return future.result(timeout=30)


@pytest.fixture
def host(server):
    h = _Host(server.address)
    yield h
    h.pool.shutdown(wait=False, cancel_futures=True)


def _assembling(server, version: int) -> dict:
    return server.status()["assembling"].get(str(version), {})


def _arrived(server, version: int, arrivals: int) -> bool:
    return _assembling(server, version).get("arrivals") == arrivals


def _pull(client, version: int) -> dict[str, np.ndarray]:
    got_version, arrays = client.pull_version(version)
    assert got_version == version
    return arrays


# --------------------------------------------------------------------------- protocol (fast)
def test_the_version_commits_when_the_last_part_arrives_with_a_deterministic_digest(
    server, client_for, host
):
    client = client_for(server.address)
    late = host.put(1, 1, 2, _stream(1, PART1))  # the second host's part may come first
    wait_for(lambda: _arrived(server, 1, 1), every_s=0.02)
    assembling = _assembling(server, 1)
    assert assembling["parts"] == 2 and assembling["received"] == [1]
    assert assembling["bytes"] == UNIT and server.status()["bytes_in_flight"] == UNIT
    assert client.latest_version() is None and not late.done()  # not visible, reply held
    with pytest.raises(ParameterServerError, match="HTTP 404"):
        client.pull_version(1)
    first = host.put(1, 0, 2, _stream(1, PART0))
    assert host.reply(first) == (200, {"version": 1, "bytes": UNIT, "part": 0, "parts": 2})
    assert host.reply(late) == (200, {"version": 1, "bytes": UNIT, "part": 1, "parts": 2})
    arrays = _pull(client, 1)
    np.testing.assert_array_equal(arrays["w"], W)
    np.testing.assert_array_equal(arrays["b"], B)
    assert server.status()["assembling"] == {} and server.status()["bytes_in_flight"] == 0

    # the same data with the parts arriving in the other order: the same digests
    futures = [host.put(2, 0, 2, _stream(2, PART0))]
    wait_for(lambda: _arrived(server, 2, 1), every_s=0.02)
    futures.append(host.put(2, 1, 2, _stream(2, PART1)))
    assert [host.reply(f)[0] for f in futures] == [200, 200]
    v1, v2 = server.store.get(1), server.store.get(2)
    assert v2.digest == v1.digest and v2.part_digests == v1.part_digests
    manifest = v2.manifest

    def head(array: np.ndarray, index: int, start: tuple, stop: tuple) -> BlockHeader:
        return BlockHeader(index, start, stop, array.nbytes, crc32c(as_bytes(array)))

    w01, w12 = head(W[0:1], 0, (0, 0), (1, 8)), head(W[1:2], 0, (1, 0), (2, 8))
    w24, b = head(W[2:4], 0, (2, 0), (4, 8)), head(B, 1, (0,), (8,))
    assert v2.digest == version_digest(manifest, [w01, w12, w24, b])  # by (array, part, order)
    latest = client._call("GET", "/v1/latest")
    assert latest["digest"] == v2.digest.hex()
    assert latest["parts"] == [
        version_digest(manifest, [w01, w12, b]).hex(),
        version_digest(manifest, [w24]).hex(),
    ]
    # a part of a committed version (a retry that comes too late) is a conflict
    status, reply = host.reply(host.put(2, 1, 2, _stream(2, PART1)))
    assert status == 409 and "not newer than the latest version 2" in reply["error"]


@pytest.mark.parametrize(
    ("part1", "message"),
    [
        ([("w", (1, 0), (4, 8))], r"array 'w': regions \[0, 0\]:\[2, 8\] and \[1, 0\]:\[4, 8\]"),
        ([("w", (3, 0), (4, 8))], r"array 'w': blocks cover 24 of its 32 elements \[4, 8\]"),
        (PART1 + [("b", (6,), (8,))], r"array 'b': regions \[0\]:\[8\] and \[6\]:\[8\] overlap"),
    ],
    ids=["overlap", "gap", "overlap-across-parts"],
)
def test_parts_whose_regions_overlap_or_leave_a_gap_reject_the_version_naming_the_array(
    server, client_for, host, part1, message
):
    first = host.put(1, 0, 2, _stream(1, [("w", (0, 0), (2, 8)), ("b", (0,), (8,))]))
    wait_for(lambda: _arrived(server, 1, 1), every_s=0.02)
    last = host.put(1, 1, 2, _stream(1, part1))
    for future in (first, last):  # every host learns why
        status, reply = host.reply(future)
        assert status == 400
        assert re.search(message, reply["error"]), reply
        assert reply["error"].startswith("push of version 1 (part ")
    client = client_for(server.address)
    assert client.latest_version() is None
    assert server.status()["assembling"] == {} and server.status()["bytes_in_flight"] == 0
    # the server stays usable: the same version, sent right, commits
    futures = [host.put(1, p, 2, _stream(1, r)) for p, r in ((0, PART0), (1, PART1))]
    assert [host.reply(f)[0] for f in futures] == [200, 200]
    np.testing.assert_array_equal(_pull(client, 1)["w"], W)


def test_a_broken_part_abandons_the_version_for_every_host(server, client_for, host):
    client = client_for(server.address)
    cases = [  # (what the second part sends, status, what every part is told)
        (
            (1, 2, _stream(1, PART1, {"w": np.zeros((4, 9), np.float32), "b": B})),
            400,
            "part 1's manifest differs from the first part's: array 'w' is float32[4, 9], "
            "in the first part float32[4, 8]",
        ),
        (
            (1, 3, _stream(1, PART1)),
            400,
            "a part says version 1 has 3 parts, an earlier one 2",
        ),
        (
            (1, 2, _stream(1, PART1, corrupt=True)),
            422,
            "part 1: block 0 (array 'w') fails its CRC32C",
        ),
    ]
    for (part, parts, body), want_status, want_message in cases:
        first = host.put(1, 0, 2, _stream(1, PART0))
        wait_for(lambda: _arrived(server, 1, 1), every_s=0.02)
        second = host.put(1, part, parts, body)
        for future in (second, first):
            status, reply = host.reply(future)
            assert status == want_status and want_message in reply["error"], reply
        assert client.latest_version() is None and server.status()["assembling"] == {}
    futures = [host.put(1, p, 2, _stream(1, r)) for p, r in ((0, PART0), (1, PART1))]
    assert [host.reply(f)[0] for f in futures] == [200, 200]


def test_a_part_sent_again_replaces_the_earlier_copy(server, client_for, host):
    wrong = {"w": W + 100, "b": B}
    futures = [host.put(1, 0, 2, _stream(1, PART0, wrong))]
    wait_for(lambda: _arrived(server, 1, 1), every_s=0.02)
    futures.append(host.put(1, 0, 2, _stream(1, PART0)))  # a retry: this copy counts
    wait_for(lambda: _arrived(server, 1, 2), every_s=0.02)
    assert _assembling(server, 1)["received"] == [0]
    futures.append(host.put(1, 1, 2, _stream(1, PART1)))
    assert [host.reply(f)[0] for f in futures] == [200, 200, 200]
    arrays = _pull(client_for(server.address), 1)
    np.testing.assert_array_equal(arrays["w"], W)


def test_the_parts_of_a_version_share_one_reservation_of_keep_bytes(make_server, client_for):
    server = make_server(keep_versions=10, keep_bytes=2 * UNIT)
    host = _Host(server.address)
    for v in (1, 2):  # version 2 fits beside version 1 only if its parts share one reservation
        for part in (0, 1):
            status, reply = _request(
                server.address,
                "POST",
                f"/v1/versions/{v}/reserve?wait_s=0",
                json.dumps({"nbytes": UNIT}).encode(),
                _part_headers(part, 2),
            )
            assert status == 200 and reply["assembly_timeout_s"] == 600.0, reply
        assert server.status()["bytes_in_flight"] == UNIT
        first = host.put(v, 0, 2, _stream(v, PART0))
        wait_for(lambda v=v: _arrived(server, v, 1), every_s=0.02)
        assert server.status()["bytes_in_flight"] == UNIT  # the reservation, claimed once
        assert host.reply(host.put(v, 1, 2, _stream(v, PART1)))[0] == 200
        assert host.reply(first)[0] == 200
    status = client_for(server.address).status()
    assert status["versions"] == [1, 2] and status["bytes_held"] == 2 * UNIT
    assert status["bytes_in_flight"] == 0
    host.pool.shutdown()


def test_parts_that_do_not_all_arrive_in_time_are_discarded(make_server, client_for):
    server = make_server(assembly_timeout_s=0.5)
    host, client = _Host(server.address), client_for(server.address)
    status, reply = host.reply(host.put(1, 0, 3, _stream(1, PART0)))
    assert status == 408
    assert reply["error"] == (
        "push of version 1 (part 0 of 3) failed: version 1 abandoned: 1 of 3 parts arrived "
        "within assembly_timeout_s=0.5s of the first (missing parts: 1, 2; a trainer host did "
        "not push it); the partial version was discarded"
    )
    assert client.latest_version() is None and server.status()["bytes_in_flight"] == 0
    # a part whose stream breaks off, nobody waiting: discarded all the same
    url = urllib.parse.urlsplit(server.address)
    body = _stream(1, PART1)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(
            f"PUT /v1/versions/1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"{PART_HEADER}: 1\r\n{PARTS_HEADER}: 2\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body[: len(body) // 2]
        )
        wait_for(lambda: _assembling(server, 1).get("streaming") == [1], every_s=0.02)
    wait_for(lambda: server.status()["assembling"] == {}, timeout_s=10, every_s=0.05)
    assert server.status()["bytes_in_flight"] == 0
    futures = [host.put(1, p, 2, _stream(1, r)) for p, r in ((0, PART0), (1, PART1))]
    assert [host.reply(f)[0] for f in futures] == [200, 200]
    host.pool.shutdown()


def test_a_version_being_assembled_conflicts_with_single_pushes(server, client_for, host):
    client = client_for(server.address)
    waiting = host.put(1, 0, 2, _stream(1, PART0))
    wait_for(lambda: _arrived(server, 1, 1), every_s=0.02)
    with pytest.raises(VersionConflictError, match="already being pushed"):
        client.push(1, {"w": W, "b": B})
    client.push(2, {"w": W, "b": B})  # a newer version: version 1 can never commit now
    status, reply = host.reply(waiting)
    assert status == 409
    assert "version 1 can no longer be committed: version 2 was committed" in reply["error"]
    assert client._call("GET", "/v1/latest")["parts"] is None  # a single-host version
    assert server.status()["assembling"] == {} and server.status()["bytes_in_flight"] == 0


def test_bad_part_headers_are_refused(server):
    for headers in ({PART_HEADER: "0"}, _part_headers(2, 2), {PART_HEADER: "x", PARTS_HEADER: "2"}):
        status, reply = _request(
            server.address, "PUT", "/v1/versions/1", _stream(1, PART0), headers
        )
        assert status == 400 and "0 <= part < parts" in reply["error"]


def test_assembly_timeout_is_a_validated_setting_and_a_cli_flag():
    args = build_parser().parse_args(["ps", "serve", "--assembly-timeout", "12.5"])
    assert args.assembly_timeout_s == 12.5
    assert build_parser().parse_args(["ps", "serve"]).assembly_timeout_s == 600.0
    assert ServerConfig(token="t").assembly_timeout_s == 600.0
    with pytest.raises(ValueError, match="assembly_timeout_s must be > 0"):
        ServerConfig(token="t", assembly_timeout_s=0)


# --------------------------------------------------------------------------- two real hosts
def _start_hosts(url: str, out_dir: str, scenario: str) -> list[subprocess.Popen]:
    """Two processes joined by jax.distributed (gloo), 4 CPU devices each, running the pusher."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLAX_")}
    env.update(
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {TEST_XLA_FLAGS}",
        RLAX_PS_TOKEN=TOKEN,
    )
    return [
        subprocess.Popen(
            [sys.executable, SCRIPT, coordinator, str(i), url, out_dir, scenario],
            env=env,
            cwd=REPO,
            stdout=open(os.path.join(out_dir, f"p{i}.log"), "w"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]


def _finish(procs: list[subprocess.Popen], out_dir: str) -> list[dict]:
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if codes != [0, 0]:
        logs = [open(os.path.join(out_dir, f"p{i}.log")).read()[-3000:] for i in range(2)]
        raise AssertionError(f"pushers exited {codes}:\n" + "\n----\n".join(logs))
    results = []
    for i in range(2):
        with open(os.path.join(out_dir, f"p{i}.json")) as fh:
            results.append(json.load(fh))
    return results


def _assert_bit_exact(arrays: dict[str, np.ndarray], version: int) -> None:
    want = expected(version)
    assert sorted(arrays) == sorted(want)
    for name, value in want.items():
        got = np.asarray(arrays[name])
        assert got.dtype == value.dtype and got.shape == value.shape, name
        assert got.tobytes() == value.tobytes(), f"{name} of version {version} differs"


VERSION_BYTES = sum(a.nbytes for a in expected(1).values())


@pytest.mark.slow
def test_two_hosts_push_a_version_that_pulls_and_mirrors_bit_exact(
    make_server, client_for, tmp_path
):
    # keep_bytes holds exactly one version: the parts must not reserve it twice
    server = make_server(keep_bytes=VERSION_BYTES)
    out = tmp_path / "out"
    out.mkdir()
    results = _finish(_start_hosts(server.address, str(out), "push"), str(out))
    assert [r["pushes"]["1"]["error"] for r in results] == [None, None]
    client = client_for(server.address)
    _assert_bit_exact(_pull(client, 1), 1)
    weights = server.store.get(1)
    assert len(weights.part_digests) == 2  # assembled from both hosts' parts
    status = client.status()
    assert status["assembling"] == {} and status["bytes_held"] == VERSION_BYTES
    # the mirror of a multi-part version restores like any other
    assert server.mirror.wait_idle(10)
    server.stop()
    restarted = make_server(keep_bytes=VERSION_BYTES)
    restored = restarted.store.get(1)
    assert (restored.digest, restored.part_digests) == (weights.digest, weights.part_digests)
    _assert_bit_exact(_pull(client_for(restarted.address), 1), 1)


@pytest.mark.slow
def test_a_host_that_never_pushes_fails_the_other_after_the_timeout_and_the_server_stays_usable(
    make_server, client_for, tmp_path
):
    server = make_server(assembly_timeout_s=3.0, keep_bytes=2 * VERSION_BYTES)
    client = client_for(server.address)
    out = tmp_path / "out"
    out.mkdir()
    procs = _start_hosts(server.address, str(out), "missing")
    try:
        # host 0's part of version 1 is in, host 1's never comes: version 1 is not visible
        wait_for(lambda: _assembling(server, 1).get("received") == [0], every_s=0.02)
        assert client.latest_version() is None
        assert client.status()["bytes_in_flight"] == VERSION_BYTES
    finally:
        results = _finish(procs, str(out))
    failed = results[0]["pushes"]["1"]
    assert failed["error"] == "PushAssemblyTimeoutError", failed
    assert "version 1 (part 0 of 2)" in failed["message"] and "HTTP 408" in failed["message"]
    assert "1 of 2 parts arrived within assembly_timeout_s=3s" in failed["message"]
    assert "missing parts: 1;" in failed["message"]
    assert 2.5 < failed["seconds"] < 30
    assert "1" not in results[1]["pushes"]  # host 1 skipped it
    # then both hosts push version 2: it commits, and a single-host push still works after it
    assert [r["pushes"]["2"]["error"] for r in results] == [None, None]
    assert server.store.versions() == [2]
    _assert_bit_exact(_pull(client, 2), 2)
    client.push(3, expected(3))
    _assert_bit_exact(_pull(client, 3), 3)
    assert client.status()["assembling"] == {}
