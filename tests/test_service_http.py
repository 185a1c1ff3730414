"""The HTTP plumbing every service shares (rlax_tasks.services.http): the bearer check
(docs/design.md §13: missing → 401, wrong → 403), and JsonClient's retries, back-off and error
mapping, also as the worker and trainer clients use it."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from rlax_tasks.services import endpoints
from rlax_tasks.services.http import (
    AuthError,
    HttpStatusError,
    JsonClient,
    authorized_app,
    backoff_s,
    check_bearer,
    send_json,
)
from rlax_tasks.services.protocol import StepConflictError, TrainerBehindError


# --------------------------------------------------------------------------- bearer auth
def test_a_missing_bearer_token_is_401_with_a_challenge():
    for header in (None, "", "Basic abc", "bearer tok"):
        with pytest.raises(AuthError) as info:
            check_bearer(header, "tok")
        assert info.value.status == 401
        assert info.value.headers == {"WWW-Authenticate": "Bearer"}
    with pytest.raises(AuthError) as info:
        check_bearer(None, "tok", realm="rlax-ps")
    assert info.value.headers == {"WWW-Authenticate": 'Bearer realm="rlax-ps"'}


def test_a_wrong_bearer_token_is_403_and_the_right_one_passes():
    for header in ("Bearer nope", "Bearer tok2", "Bearer ", "Bearer tö"):
        with pytest.raises(AuthError) as info:
            check_bearer(header, "tok")
        assert info.value.status == 403 and not info.value.headers
    check_bearer("Bearer tok", "tok")
    check_bearer(None, None)  # a service without a token is open
    check_bearer(None, "")


def test_a_fastapi_app_answers_401_403_and_serves_the_right_token():
    from fastapi.testclient import TestClient

    app = authorized_app("test", "s3cret")

    @app.get("/ping")
    def ping() -> dict:
        return {"pong": True}

    client = TestClient(app)
    missing = client.get("/ping")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert client.get("/ping", headers={"Authorization": "Bearer nope"}).status_code == 403
    ok = client.get("/ping", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json() == {"pong": True}
    for path in ("/docs", "/openapi.json"):  # no API docs, not even behind the token
        assert client.get(path).status_code == 401
        assert client.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 404
    with pytest.raises(ValueError, match="RLAX_PS_TOKEN"):  # a service never runs open
        authorized_app("open", None)
    with pytest.raises(ValueError, match="RLAX_PS_TOKEN"):
        authorized_app("open", "")


def test_a_request_is_refused_before_its_body_is_read():
    """The guard answers a stranger (401) and an oversized or malformed Content-Length (413,
    400) without reading any of the body: the app's receive is never called."""
    import asyncio

    from rlax_tasks.services.http import RequestGuard

    async def app(scope, receive, send):  # noqa: ANN001, ANN202 - reached only when allowed
        raise AssertionError("the app was reached")

    guard = RequestGuard(app, "tok", max_body_bytes=100)

    def answer(headers: dict[str, str]) -> int:
        sent, read = [], []

        async def receive() -> dict:
            read.append(1)
            return {"type": "http.request", "body": b"x" * 10, "more_body": True}

        async def send(message: dict) -> None:
            sent.append(message)

        raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        scope = {"type": "http", "method": "POST", "path": "/", "headers": raw}
        asyncio.run(guard(scope, receive, send))
        assert read == [], "the body was read"
        return sent[0]["status"]

    auth = {"Authorization": "Bearer tok"}
    assert answer({"Content-Length": "10"}) == 401
    assert answer({"Authorization": "Bearer nope", "Content-Length": "10"}) == 403
    assert answer({**auth, "Content-Length": str(10**10)}) == 413
    assert answer({**auth, "Content-Length": "-5"}) == 400


def test_wait_seconds_are_finite_non_negative_and_capped():
    from rlax_tasks.services.http import MAX_WAIT_S, check_wait_s

    assert check_wait_s("2.5") == 2.5 and check_wait_s(0) == 0.0
    assert check_wait_s(MAX_WAIT_S) == MAX_WAIT_S
    for bad, why in (("nan", "finite"), (float("inf"), "finite"), ("-1", ">= 0"),
                     (MAX_WAIT_S + 1, "at most 300 seconds"), ("soon", "finite")):  # fmt: skip
        with pytest.raises(ValueError, match=why) as info:
            check_wait_s(bad, "wait_s")
        assert str(info.value).startswith("wait_s ")


def test_one_token_per_run_from_the_environment():
    from rlax_tasks.services.http import TOKEN_ENV, run_token, service_token

    assert TOKEN_ENV == "RLAX_PS_TOKEN"
    assert service_token({TOKEN_ENV: "abc"}) == "abc"
    for env in ({}, {TOKEN_ENV: ""}, {TOKEN_ENV: "  "}):
        with pytest.raises(ValueError, match="RLAX_PS_TOKEN is not set"):
            service_token(env)
    assert run_token({TOKEN_ENV: "mine"}) == "mine"  # the user's, when exported
    new = run_token({})
    assert len(new) == 32 and new != run_token({})


# --------------------------------------------------------------------------- JsonClient
def _free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    """The back-off waits JsonClient takes (recorded, and kept short)."""
    taken: list[float] = []
    real_sleep = time.sleep

    def sleep(seconds: float) -> None:
        taken.append(seconds)
        real_sleep(min(seconds, 0.01))

    monkeypatch.setattr("rlax_tasks.services.http.time.sleep", sleep)
    return taken


def test_backoff_doubles_up_to_its_cap():
    assert [backoff_s(a, 0.1, 1.0) for a in range(6)] == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0]


def test_a_refused_connection_is_retried_with_backoff_then_unreachable(sleeps):
    url = f"http://127.0.0.1:{_free_port()}"
    client = JsonClient(
        url,
        retries=3,
        backoff_s=0.1,
        max_backoff_s=0.25,
        unreachable=lambda e, what: ConnectionError(f"gone: {what}: {e}"),
    )
    with pytest.raises(ConnectionError, match="gone: GET /v1/status") as info:
        client.call("GET", "/v1/status")
    assert isinstance(info.value.__cause__, ConnectionRefusedError)
    assert sleeps == [0.1, 0.2, 0.25]  # three retries after the first attempt


def test_retries_stop_at_the_deadline(monkeypatch):
    url = f"http://127.0.0.1:{_free_port()}"
    client = JsonClient(url, retries=None, give_up_after_s=0.5, backoff_s=0.05, max_backoff_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(ConnectionRefusedError):  # by default the error itself
        client.call("GET", "/")
    assert 0.5 <= time.monotonic() - t0 < 5.0


def test_no_retries_means_one_attempt(sleeps):
    client = JsonClient(f"http://127.0.0.1:{_free_port()}")
    with pytest.raises(ConnectionRefusedError):
        client.call("GET", "/")
    assert sleeps == []


class _Script(http.server.BaseHTTPRequestHandler):
    """Answers each request with the next (status, JSON body) of the server's ``script``
    (the last one again when it runs out), recording what it was sent."""

    def _answer(self) -> None:
        server = self.server
        length = int(self.headers.get("Content-Length") or 0)
        server.seen.append((self.command, self.path, dict(self.headers), self.rfile.read(length)))
        status, body = server.script[min(len(server.seen) - 1, len(server.script) - 1)]
        send_json(self, status, body)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[http.server.HTTPServer]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Script)
    server.script, server.seen = [(200, {})], []
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: http.server.HTTPServer) -> str:
    return endpoints.url_of(*server.server_address[:2])


def test_json_bodies_token_and_an_error_status(scripted):
    scripted.script = [(200, {"ok": 1}), (404, {"detail": "no such thing"})]
    client = JsonClient(_url(scripted), "tok")
    assert client.call("POST", "/v1/x", {"a": [1, 2]}) == {"ok": 1}
    method, path, headers, body = scripted.seen[0]
    assert (method, path, json.loads(body)) == ("POST", "/v1/x", {"a": [1, 2]})
    assert headers["Authorization"] == "Bearer tok"
    assert headers["Content-Type"] == "application/json"
    with pytest.raises(HttpStatusError, match="GET /v1/y: HTTP 404: .*no such thing") as info:
        client.call("GET", "/v1/y")
    assert info.value.reply.status == 404
    assert "Authorization" not in JsonClient(_url(scripted)).headers()


def test_a_transient_status_is_retried_and_others_are_refused(scripted, sleeps):
    scripted.script = [(503, {}), (503, {}), (200, {"done": True})]
    client = JsonClient(_url(scripted), retries=5, backoff_s=0.01, retry_status=lambda s: s >= 500)
    assert client.call("GET", "/") == {"done": True}
    assert len(scripted.seen) == 3 and len(sleeps) == 2
    scripted.seen.clear()
    scripted.script = [(400, {"detail": "bad"})]
    with pytest.raises(ValueError, match="refused: 400"):
        JsonClient(
            _url(scripted),
            retries=5,
            retry_status=lambda s: s >= 500,
            refused=lambda reply, what: ValueError(f"refused: {reply.status}"),
        ).call("GET", "/")
    assert len(scripted.seen) == 1  # not retried


def test_a_service_file_is_followed_once_it_is_published(tmp_path, scripted, monkeypatch):
    path = endpoints.service_file(str(tmp_path), "svc")
    client = JsonClient(endpoints.Endpoint(path, refresh_s=0.0), retries=3, backoff_s=0.01)

    def publish_on_sleep(seconds: float) -> None:  # the service comes up during the back-off
        endpoints.publish(path, _url(scripted))

    # nothing published yet: a connection error (NotPublishedError), retried
    monkeypatch.setattr("rlax_tasks.services.http.time.sleep", publish_on_sleep)
    scripted.script = [(200, {"here": True})]
    assert client.call("GET", "/") == {"here": True}


# --------------------------------------------------------------------------- the clients on it
def test_worker_client_maps_400_to_value_error_and_the_rest_to_connection_error(scripted):
    from rlax_tasks.rollout.service import WorkerClient

    scripted.script = [(400, {"detail": "group_size"}), (500, {"detail": "boom"})]
    client = WorkerClient(_url(scripted), token="tok")
    with pytest.raises(ValueError, match="rejected the request: .*group_size"):
        client.submit([{}])
    with pytest.raises(ConnectionError, match="HTTP 500"):
        client.status()
    with pytest.raises(ConnectionError, match="unreachable"):
        WorkerClient(f"http://127.0.0.1:{_free_port()}").status()


def test_trainer_client_retries_a_restarting_trainer_and_maps_409_and_4xx(scripted, sleeps):
    np = pytest.importorskip("numpy")
    from rlax_tasks.trainer.service import TrainerClient

    arrays = {"x": np.zeros(2)}
    scripted.script = [(503, {}), (200, {"version": 1, "replayed": False})]
    client = TrainerClient(_url(scripted), token="t", give_up_after_s=30, retry_s=0.01)
    assert client.train(1, arrays)["version"] == 1 and sleeps == [0.01]
    scripted.seen.clear()
    scripted.script = [(409, {"detail": {"message": "behind", "trainer_step": 3}})]
    with pytest.raises(TrainerBehindError) as info:
        client.train(5, arrays)
    # the controller's TrainerBehindError: not a ValueError (a configuration error, exit 2)
    assert info.value.trainer_step == 3 and not isinstance(info.value, StepConflictError)
    scripted.script = [(400, {"detail": "rewards missing"})]
    with pytest.raises(RuntimeError, match=r"refused step 2 \(HTTP 400\).*rewards"):
        client.train(2, arrays)
    with pytest.raises(ConnectionError, match="unreachable for step 2"):
        TrainerClient(f"http://127.0.0.1:{_free_port()}", give_up_after_s=0.2, retry_s=0.01).train(
            2, arrays
        )


def test_worker_client_maps_a_refused_token_and_an_oversized_submission(scripted):
    from rlax_tasks.rollout.service import WorkerClient

    client = WorkerClient(_url(scripted), token="tok")
    scripted.script = [(403, {"detail": "wrong bearer token"})]
    with pytest.raises(RuntimeError, match="same RLAX_PS_TOKEN") as info:
        client.status()
    assert not isinstance(info.value, ConnectionError)  # not a dead worker: no retry mends it
    scripted.script = [(413, {"detail": "too large"})]
    with pytest.raises(ValueError, match="too large"):  # the controller then sends one by one
        client.submit([{}])


def test_trainer_client_raises_a_replay_it_did_not_cause_and_takes_one_it_did(scripted, sleeps):
    """A replay answer to the first attempt: someone else's step (StepReplayedError, for the
    controller to judge); after a retry: our own lost answer (returned)."""
    np = pytest.importorskip("numpy")
    from rlax_tasks.services.protocol import StepReplayedError
    from rlax_tasks.trainer.service import TrainerClient

    arrays = {"x": np.zeros(2)}
    replayed = {"version": 3, "replayed": True, "metrics": None}
    client = TrainerClient(_url(scripted), token="t", give_up_after_s=30, retry_s=0.01)
    scripted.script = [(200, replayed)]
    with pytest.raises(StepReplayedError, match="already applied step 3") as info:
        client.train(3, arrays)
    assert info.value.version == 3
    scripted.seen.clear()
    scripted.script = [(503, {}), (200, replayed)]
    assert client.train(3, arrays)["replayed"] is True and len(scripted.seen) == 2
