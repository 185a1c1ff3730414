"""Every request is bounded (docs/design.md §13): wait times finite and capped, sizes within the
service's limits, bodies refused before they are read, long-polls that never starve a service
or hold up its shutdown; a bad request gets a 4xx and the service stays responsive."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests.compute.helpers import wait_for
from tests.service_fakes import (
    AUTH,
    TOKEN,
    CountingTrainer,
    IdleWorker,
    request,
    served,
    timed,
)

BAD_WAITS = ("nan", "inf", "-inf", "-1", "300.5", "1e9", "soon")
HUGE = str(10 * 1024**3)  # a Content-Length of 10 GiB, sent with a body of a few bytes
JSON_AUTH = {**AUTH, "Content-Type": "application/json"}


def _group(prompt_id: str, group_size: int) -> dict:
    return {"prompt_id": prompt_id, "prompt_tokens": [5, 6], "group_size": group_size}


# --------------------------------------------------------------------------- parameter server
@pytest.fixture
def ps():
    from rlax_tasks.paramserver.server import ParameterServer, ServerConfig

    with ParameterServer(ServerConfig(token=TOKEN)) as server:
        yield server.address


def test_parameter_server_refuses_bad_waits_and_stays_responsive(ps):
    for wait in BAD_WAITS:
        for path in (f"/v1/pull?wait_s={wait}", f"/v1/versions/1/reserve?wait_s={wait}"):
            method = "GET" if "pull" in path else "POST"
            body = None if method == "GET" else b'{"nbytes": 1}'
            (status, reply, _), took = timed(
                lambda m=method, p=path, b=body: request(ps, m, p, b, AUTH)
            )
            assert status == 400 and "wait_s" in json.loads(reply)["error"], (path, reply)
            assert took < 5
        (status, _, _), took = timed(lambda: request(ps, "GET", "/v1/status", headers=AUTH))
        assert status == 200 and took < 2
    status, reply, _ = request(ps, "GET", "/v1/pull?wait_s=500", headers=AUTH)
    assert "at most 300 seconds" in json.loads(reply)["error"]
    assert request(ps, "GET", "/v1/pull?wait_s=0.05", headers=AUTH)[0] == 204  # a valid wait
    for path in ("/v1/pull?min_version=-1", "/v1/versions/-3"):
        assert request(ps, "GET", path, headers=AUTH)[0] == 400


def test_parameter_server_refuses_oversized_bodies_before_reading_them(ps):
    from rlax_tasks.paramserver.wire import ArraySpec, Manifest

    # a JSON request: refused on its Content-Length (the 10 GiB never come)
    headers = {**JSON_AUTH, "Content-Length": HUGE}
    (status, reply, _), took = timed(
        lambda: request(ps, "POST", "/v1/versions/1/reserve", b"{}", headers)
    )
    assert status == 413 and took < 5, reply
    chunked = {**JSON_AUTH, "Transfer-Encoding": "chunked"}
    assert request(ps, "POST", "/v1/workers/w0/ack", b"0\r\n\r\n", chunked)[0] == 411
    # a push: its Content-Length must fit the manifest it starts with
    manifest = Manifest(1, (ArraySpec("w", "float32", (4,)),), num_blocks=1).encode()
    headers = {**AUTH, "Content-Length": HUGE}
    (status, reply, _), took = timed(
        lambda: request(ps, "PUT", "/v1/versions/1", manifest, headers)
    )
    assert status == 413 and "more than its 1 blocks" in json.loads(reply)["error"], reply
    assert took < 5
    assert json.loads(request(ps, "GET", "/v1/latest", headers=AUTH)[1])["version"] is None


# --------------------------------------------------------------------------- worker
@pytest.fixture
def worker_url():
    from rlax_tasks.rollout.service import create_app

    with served(create_app(IdleWorker(), TOKEN)) as url:
        yield url


def test_worker_refuses_bad_waits_and_stays_responsive(worker_url):
    for wait in (*BAD_WAITS, "300.5"):
        path = f"/v1/results?wait_s={urllib.parse.quote(wait)}"
        (status, reply, _), took = timed(lambda p=path: request(worker_url, "GET", p, headers=AUTH))
        assert status == 422 and "wait_s" in reply.decode(), (wait, reply)
        (status, _, _), took = timed(lambda: request(worker_url, "GET", "/v1/status", headers=AUTH))
        assert status == 200 and took < 2
    reply = request(worker_url, "GET", "/v1/results?wait_s=301", headers=AUTH)[1]
    assert "at most 300 seconds" in reply.decode()
    for bad in ("0", "-2", "100000"):
        assert request(worker_url, "GET", f"/v1/results?max_groups={bad}", headers=AUTH)[0] == 422


def test_worker_refuses_groups_over_its_limits(worker_url):
    from rlax_tasks.rollout.service import MAX_GROUP_SIZE, MAX_SAMPLES

    def submit(groups: list[dict]) -> tuple[int, str]:
        body = json.dumps({"groups": groups}).encode()
        status, reply, _ = request(worker_url, "POST", "/v1/groups", body, JSON_AUTH)
        return status, reply.decode()

    (status, reply), took = timed(lambda: submit([_group("huge", 10**9)]))
    assert status == 400 and "group_size must be at most" in reply and took < 5
    assert submit([_group("big", MAX_GROUP_SIZE + 1)])[0] == 400
    many = [_group(f"p{i}", MAX_GROUP_SIZE) for i in range(MAX_SAMPLES // MAX_GROUP_SIZE + 1)]
    status, reply = submit(many)
    assert status == 400 and "completions" in reply
    assert submit([_group("ok", MAX_GROUP_SIZE)]) == (200, '{"accepted":1}')


def test_worker_refuses_oversized_bodies_before_reading_them(worker_url):
    headers = {**JSON_AUTH, "Content-Length": HUGE}
    (status, reply, _), took = timed(
        lambda: request(worker_url, "POST", "/v1/groups", b'{"groups"', headers)
    )
    assert status == 413 and "exceeds" in reply.decode() and took < 5


def test_a_streamed_body_is_cut_off_at_the_limit():
    """No Content-Length (chunked): 413 as soon as the bytes read pass the limit, though the
    body never ends."""
    from rlax_tasks.rollout.service import create_app

    with served(create_app(IdleWorker(), TOKEN, max_body_bytes=1000)) as url:
        parsed = urllib.parse.urlsplit(url)
        with socket.create_connection((parsed.hostname, parsed.port), timeout=10) as sock:
            head = ["POST /v1/groups HTTP/1.1", "Host: worker", "Transfer-Encoding: chunked",
                    *(f"{k}: {v}" for k, v in JSON_AUTH.items())]  # fmt: skip
            sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n")
            for _ in range(3):  # 3000 bytes, and no final chunk: the body goes on and on
                sock.sendall(b"3e8\r\n" + b" " * 1000 + b"\r\n")
            reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 413"), reply
        assert b"more than" in reply
        client = TestClient(create_app(IdleWorker(), TOKEN, max_body_bytes=1000))
        small = client.post("/v1/groups", content=iter([b'{"groups": []}']), headers=JSON_AUTH)
        assert small.status_code == 200


def test_sixty_long_polls_leave_the_worker_responsive():
    from rlax_tasks.rollout.requests import Completion, GroupResult, Request
    from rlax_tasks.rollout.service import create_app

    worker = IdleWorker()
    with served(create_app(worker, TOKEN)) as url:
        answers: list[tuple[int, bytes]] = []
        path = "/v1/results?wait_s=20&max_groups=1"

        def poll() -> None:
            status, body, _ = request(url, "GET", path, headers=AUTH, timeout_s=60)
            answers.append((status, body))

        polls = [threading.Thread(target=poll, daemon=True) for _ in range(60)]
        for t in polls:
            t.start()
        wait_for(lambda: url.open_requests() >= 60)  # all 60 are waiting on the worker
        (status, _, _), took = timed(lambda: request(url, "GET", "/v1/status", headers=AUTH))
        assert status == 200 and took < 2.0, took
        assert answers == []
        # results arriving during the wait are handed out at once, one to each poll: all 60
        # answered within a bound far below the polls' 20 s wait
        results = [
            GroupResult(f"p{i}", 0, (5,), [Completion(Request((5,)), [7], [-0.1], "eos")], None, 0)
            for i in range(60)
        ]
        with worker.lock:
            worker.ready.extend(results)
        handed_out = time.monotonic()
        deadline = handed_out + 5.0
        for t in polls:
            t.join(max(0.0, deadline - time.monotonic()))
        took = time.monotonic() - handed_out
        assert not any(t.is_alive() for t in polls), f"{len(answers)} of 60 answered in {took:.1f}s"
        assert [s for s, _ in answers] == [200] * 60
        ids = sorted(json.loads(b)["results"][0]["prompt_id"] for _, b in answers)
        assert ids == sorted(f"p{i}" for i in range(60))


_SERVE_IDLE_WORKER = """
import sys
from rlax_tasks.services.endpoints import listen
from rlax_tasks.rollout.service import GRACEFUL_S, create_app
from rlax_tasks.services.http import serve_app, service_token
from tests.service_fakes import IdleWorker

sock, url = listen("127.0.0.1", 0)
print(url, flush=True)
serve_app(create_app(IdleWorker(), service_token()), sock, graceful_s=GRACEFUL_S)
"""


def test_a_worker_with_a_long_poll_open_stops_promptly_on_sigterm():
    """The worker command's serving (``serve_app`` with the worker's ``GRACEFUL_S``): SIGTERM
    during a 60 s long-poll ends the process within seconds."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVE_IDLE_WORKER],
        cwd=repo,
        env={**os.environ, "RLAX_PS_TOKEN": TOKEN},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        poll = threading.Thread(
            target=lambda: request(url, "GET", "/v1/results?wait_s=60", headers=AUTH, timeout_s=90)
        )
        poll.daemon = True
        poll.start()
        assert request(url, "GET", "/v1/status", headers=AUTH)[0] == 200
        proc.send_signal(signal.SIGTERM)
        (_, took) = timed(lambda: proc.wait(timeout=30))
        assert took < 10, took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- trainer
@pytest.fixture
def trainer_app():
    from rlax_tasks.trainer.http_app import create_app
    from rlax_tasks.trainer.service import TrainerService

    service = TrainerService(CountingTrainer()).start()
    return service, create_app(service, TOKEN, max_body_bytes=64 * 1024)


def _npz(compress: bool = False, **arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compress else np.savez)(buf, **arrays)
    return buf.getvalue()


def test_trainer_refuses_oversized_and_unpacking_bodies_and_bad_steps(trainer_app):
    service, app = trainer_app
    with served(app) as url:
        headers = {**AUTH, "Content-Length": HUGE}
        (status, reply, _), took = timed(
            lambda: request(url, "POST", "/v1/steps/1", b"PK", headers)
        )
        assert status == 413 and took < 5, reply
    client = TestClient(app)
    # a 1 MB array of zeros compresses to about a kilobyte: refused before it is unpacked
    bomb = _npz(compress=True, rewards=np.zeros(1 << 20, np.uint8))
    assert len(bomb) < 64 * 1024
    reply = client.post("/v1/steps/1", content=bomb, headers=AUTH)
    assert reply.status_code == 413 and "unpacks to" in reply.json()["detail"]
    small = _npz(rewards=np.ones(2, np.float32))
    for step in ("0", "-1", "x"):
        assert client.post(f"/v1/steps/{step}", content=small, headers=AUTH).status_code == 422
    assert client.post("/v1/steps/1", content=b"not an npz", headers=AUTH).status_code == 400
    assert service.step == 0
    assert client.post("/v1/steps/1", content=small, headers=AUTH).status_code == 200
    assert service.step == 1


def test_the_trainer_body_limit_is_sized_from_the_batch():
    from rlax_tasks.trainer.service import batch_body_limit, step_arrays

    class Batch:  # 8 rows of 300 tokens, as the controller's Batch gives them
        version = 1

        def arrays(self) -> dict[str, np.ndarray]:
            ids = np.zeros((8, 300), np.int32)
            return {
                "input_ids": ids,
                "attention_mask": ids,
                "mask": ids.astype(np.float32),
                "behavior_logprobs": ids.astype(np.float32),
                "rewards": np.zeros(8),
            }

        def stats(self) -> dict[str, float]:
            return {"prompts_skipped": 1.0}

    body = _npz(**step_arrays(Batch()))
    assert len(body) < batch_body_limit(8, 300) < 4 * len(body) + (1 << 20)


# --------------------------------------------------------------------------- verifier
def test_verifier_bounds_its_fields_and_bodies():
    from rlax_tasks.rewards.service import create_app

    client = TestClient(create_app(TOKEN, math_workers=1))
    headers = {**JSON_AUTH, "Content-Length": HUGE}
    reply = client.post("/v1/code/run", content=b"{}", headers=headers)
    assert reply.status_code == 413
    for field, value in (("timeout_s", float("inf")), ("memory_mb", 10**9), ("language", "x" * 99)):
        body = json.dumps({"source": "print(1)", field: value})
        reply = client.post("/v1/code/run", content=body, headers=JSON_AUTH)
        assert reply.status_code == 422 and field in reply.text, (field, reply.text)
