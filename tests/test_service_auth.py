"""Every service of a run needs the run's one token (docs/design.md §13): missing → 401 with a
challenge, wrong → 403, right → served, through each real app; a service never starts without
it; and the controller never takes a trainer's replay of a step it did not send for success."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from rlax_tasks.services.http import TOKEN_ENV
from rlax_tasks.services.protocol import StepReplayedError
from tests.service_fakes import AUTH, TOKEN, CountingTrainer, IdleWorker, request, served

WRONG = {"Authorization": "Bearer not-the-run-token"}
NO_ITEMS = {"items": []}


def _npz(**arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _reply(response) -> tuple[int, dict]:  # noqa: ANN001 - a TestClient response
    return response.status_code, response.headers


def _assert_guarded(call) -> None:  # noqa: ANN001 - call(headers) -> (status, headers)
    status, headers = call({})
    assert status == 401 and headers["www-authenticate"].startswith("Bearer")
    assert call(WRONG)[0] == 403
    assert call(AUTH)[0] == 200


def test_parameter_server_401_403_and_the_run_token():
    from rlax_tasks.paramserver.server import ParameterServer, ServerConfig

    with ParameterServer(ServerConfig(token=TOKEN)) as ps:
        _assert_guarded(lambda h: request(ps.address, "GET", "/v1/status", headers=h)[::2])


def test_trainer_refuses_a_strangers_step_and_takes_the_controllers():
    from rlax_tasks.trainer.http_app import create_app
    from rlax_tasks.trainer.service import TrainerService

    trainer = CountingTrainer()
    service = TrainerService(trainer).start()
    client = TestClient(create_app(service, TOKEN))
    _assert_guarded(lambda h: _reply(client.get("/v1/status", headers=h)))
    batch = _npz(rewards=np.ones(2, np.float32))
    stranger = client.post("/v1/steps/1", content=batch)
    assert stranger.status_code == 401
    assert client.post("/v1/steps/1", content=batch, headers=WRONG).status_code == 403
    assert service.step == 0 and trainer.batches == []  # neither was applied
    ok = client.post("/v1/steps/1", content=batch, headers=AUTH)
    assert ok.status_code == 200 and ok.json()["replayed"] is False
    assert service.step == 1 and len(trainer.batches) == 1


def test_worker_401_403_and_the_run_token():
    from rlax_tasks.rollout.service import create_app

    with served(create_app(IdleWorker(), TOKEN)) as url:
        for path in ("/v1/status", "/v1/results?wait_s=0", "/healthz"):
            _assert_guarded(lambda h, path=path: request(url, "GET", path, headers=h)[::2])
        body = json.dumps({"groups": []}).encode()
        # the guard answers before any byte of the body is read, also to a stranger's POST
        assert request(url, "POST", "/v1/groups", body)[0] == 401
        json_auth = {**AUTH, "Content-Type": "application/json"}
        assert request(url, "POST", "/v1/groups", body, headers=json_auth)[0] == 200


def test_verifier_401_403_and_the_run_token():
    from rlax_tasks.rewards.service import VerifierClient, VerifierError, create_app

    app = create_app(TOKEN, math_workers=1)
    with TestClient(app) as client:
        _assert_guarded(lambda h: _reply(client.post("/v1/math/verify", json=NO_ITEMS, headers=h)))
        # code execution too: a stranger never reaches the sandbox
        run = {"source": "print(1)"}
        assert client.post("/v1/code/run", json=run).status_code == 401
    with served(app) as url:
        assert VerifierClient(url, token=TOKEN).check_math([]) == []
        with pytest.raises(VerifierError, match="401"):
            VerifierClient(url, token="").check_math([])


def test_no_service_and_no_controller_starts_without_the_run_token(monkeypatch, capsys, tmp_path):
    """`rlax ps serve | worker | trainer | controller | verify serve` without RLAX_PS_TOKEN:
    exit 2 with one line naming the variable, before loading anything."""
    from rlax_tasks.cli import main

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    url = "http://127.0.0.1:9"
    commands = [
        ["ps", "serve", "--port", "0"],
        ["worker", "--model-dir", str(tmp_path / "no-model")],
        ["trainer", "--config", str(tmp_path / "no-config.yaml")],
        ["controller", "--config", "x.yaml", "--trainer-url", url, "--workers-file", "w.json"],
        ["verify", "serve", "--port", "0"],
    ]
    for argv in commands:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{TOKEN_ENV} is not set" in err, (argv, err)


# --------------------------------------------------------------------------- replays
def _replaying(fake, elsewhere: frozenset[int]):  # noqa: ANN001, ANN202 - a FakeTrainer
    """``fake`` as the controller sees a trainer through ``TrainerClient``: a step it had
    applied already, or one in ``elsewhere`` (applied from another client's batch), is raised
    as ``StepReplayedError`` (a replay the client did not cause)."""

    def train_step(batch) -> int:  # noqa: ANN001
        if batch.version <= fake.version or batch.version in elsewhere:
            fake.replays += 1
            raise StepReplayedError(batch.version, batch.version)
        return fake(batch)

    return train_step


def _controller(run_dir: str, world, elsewhere: frozenset[int] = frozenset()):  # noqa: ANN001, ANN202
    from tests.controller.fakes import controller

    c = controller(run_dir, world)
    c.train_step = _replaying(world.trainer, elsewhere)
    return c


def test_the_controller_raises_on_a_replay_of_a_step_it_never_sent(tmp_path, caplog):
    from rlax_tasks.controller import read_lineage
    from tests.controller.fakes import World

    world = World()
    c = _controller(str(tmp_path), world, elsewhere=frozenset({1}))  # a stranger's step 1
    c.start()
    with pytest.raises(RuntimeError, match="never sent"):
        c.run(1, max_iterations=200)
    assert c.step == 0 and read_lineage(str(tmp_path)) == []
    assert any("never sent it" in r.message and r.levelname == "ERROR" for r in caplog.records)


def test_the_controller_takes_the_replay_of_its_own_pending_step_after_a_restart(tmp_path):
    """Killed after the trainer applied step 2 but before it heard back: the restored
    controller re-sends that step, the answer is a replay, and the run goes on."""
    from rlax_tasks.controller import read_lineage
    from tests.controller.fakes import World

    world = World()
    first = _controller(str(tmp_path), world)
    first.start()
    first.run(1, max_iterations=200)
    world.trainer.crash_after_next = True
    with pytest.raises(KeyboardInterrupt):
        first.run(2, max_iterations=200)
    second = _controller(str(tmp_path), world)
    assert second.start() is True and second.step == 2
    assert world.trainer.replays == 1
    second.run(3, max_iterations=200)
    assert [r["step"] for r in read_lineage(str(tmp_path))] == [1, 2, 3]
