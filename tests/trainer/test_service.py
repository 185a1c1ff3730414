"""The trainer service: idempotent numbered steps, checkpoint-then-push, republishing to the PS."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import jax
import numpy as np
import pytest

from rlax_tasks.algorithms import make_objective
from rlax_tasks.controller import TrainerBehindError
from rlax_tasks.paramserver import ParameterServerClient
from rlax_tasks.paramserver.server import ParameterServer, ServerConfig
from rlax_tasks.trainer.config import TrainerConfig
from rlax_tasks.trainer.http_app import create_app
from rlax_tasks.trainer.metrics import read_metrics
from rlax_tasks.trainer.service import (
    StepConflictError,
    StepReplayedError,
    TrainerClient,
    TrainerService,
)
from rlax_tasks.trainer.trainer import Trainer
from tests.trainer.helpers import random_batch, tiny_policy

CONFIG = TrainerConfig(learning_rate=1e-3, mesh_shape=(1, 1, 1), async_checkpointing=False)


def make_service(
    run_dir: str, ps: ParameterServerClient | None, checkpoint_every: int = 1
) -> TrainerService:
    config = dataclasses.replace(CONFIG, checkpoint_every=checkpoint_every)
    trainer = Trainer(tiny_policy(), make_objective("grpo", kl_beta=0.0), config, run_dir)
    return TrainerService(trainer, ps, repush_every_s=0.2).start()


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_steps_are_idempotent_durable_and_published(tmp_path):
    run_dir = str(tmp_path / "run")
    with ParameterServer(ServerConfig(token="t", keep_versions=3)) as server:
        ps = ParameterServerClient(server.address, token="t")
        service = make_service(run_dir, ps)
        assert ps.latest_version() == 0  # the base weights are version 0
        out = service.train(1, random_batch(1))
        assert out["version"] == 1 and not out["replayed"] and np.isfinite(out["metrics"]["loss"])
        after_one = leaves(service.trainer.params)
        again = service.train(1, random_batch(99))  # a replay: not applied a second time
        assert again["replayed"] and again["version"] == 1
        for a, b in zip(after_one, leaves(service.trainer.params), strict=True):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(StepConflictError, match="cannot follow"):
            service.train(3, random_batch(3))
        assert ps.latest_version() == 1
        _, pulled = ps.pull(min_version=1)
        assert len(pulled) == len(after_one)
        service.stop()

        # a new process: restores step 1 from its checkpoint; step 0 is now too old
        restored = make_service(run_dir, ps)
        assert restored.step == 1
        for a, b in zip(after_one, leaves(restored.trainer.params), strict=True):
            np.testing.assert_array_equal(a, b)
        with pytest.raises(StepConflictError, match="older"):
            restored.train(0, random_batch(0))
        restored.stop()
        ps.close()


def test_a_parameter_server_that_lost_the_version_gets_it_again(tmp_path):
    run_dir = str(tmp_path / "run")
    with ParameterServer(ServerConfig(token="t")) as first:
        ps = ParameterServerClient(first.address, token="t")
        service = make_service(run_dir, ps)
        service.train(1, random_batch(1))
        service.stop()
        ps.close()
    with ParameterServer(ServerConfig(token="t")) as empty:  # restarted without a mirror
        ps = ParameterServerClient(empty.address, token="t")
        service = make_service(run_dir, ps)
        assert ps.latest_version() == 1
        service.stop()
        ps.close()


def test_http_client_retries_until_the_trainer_is_up_and_errors_are_clear(tmp_path):
    import uvicorn

    service = make_service(str(tmp_path / "run"), None)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(create_app(service, token="tok"), log_level="warning"))
    client = TrainerClient(url, token="tok", give_up_after_s=60, retry_s=0.2)
    # the first attempts find no server (a restarting trainer); the step still goes through
    threading.Timer(1.0, lambda: server.run(sockets=[sock])).start()
    try:
        out = client.train(1, random_batch(1))
        assert out["version"] == 1 and out["replayed"] is False
        with pytest.raises(StepReplayedError, match="already applied step 1"):
            client.train(1, random_batch(1))
        with pytest.raises(TrainerBehindError, match="cannot follow") as behind:
            client.train(5, random_batch(5))
        assert behind.value.trainer_step == 1
        with pytest.raises(RuntimeError, match="403"):
            TrainerClient(url, token="wrong").train(2, random_batch(2))
        bad = random_batch(2)
        del bad["rewards"]
        with pytest.raises(RuntimeError, match="rewards"):
            client.train(2, bad)
    finally:
        server.should_exit = True
        time.sleep(0.3)
        service.stop()


def test_checkpoint_every_n_steps_and_replay_after_a_crash(tmp_path):
    """checkpoint_every=3: killed after step 5, the trainer restarts at step 3, asks for steps 4
    and 5 again, and applying them gives bit for bit the weights it had; metrics and the PS
    keep one record per step."""
    run_dir = str(tmp_path / "run")
    batches = {s: random_batch(s) for s in range(1, 7)}
    with ParameterServer(ServerConfig(token="t", keep_versions=8)) as server:
        ps = ParameterServerClient(server.address, token="t")
        service = make_service(run_dir, ps, checkpoint_every=3)
        for s in range(1, 6):
            service.train(s, batches[s])
        at_five = leaves(service.trainer.params)
        service.trainer.wait_for_checkpoint()  # the save of step 3 finished; then kill -9
        service._stop.set()  # (its re-push thread dies with it)
        assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["3"]

        restarted = make_service(run_dir, ps, checkpoint_every=3)
        assert restarted.step == 3 and ps.latest_version() == 5
        with pytest.raises(TrainerBehindError) as behind:
            restarted.train(6, batches[6])
        assert behind.value.trainer_step == 3
        for s in (4, 5):
            assert restarted.train(s, batches[s])["replayed"] is False
        for a, b in zip(at_five, leaves(restarted.trainer.params), strict=True):
            np.testing.assert_array_equal(a, b)
        restarted.train(6, batches[6])
        assert ps.latest_version() == 6
        restarted.stop()  # a clean stop checkpoints step 6
        assert "6" in os.listdir(os.path.join(run_dir, "checkpoints"))
        steps = [r["step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]
        assert steps == [1, 2, 3, 4, 5, 6]
        ps.close()


def test_stat_scalars_go_to_the_metrics_row_not_to_the_train_step(tmp_path, monkeypatch):
    """The controller's per-step counts travel with the batch as ``stat_*`` scalars (prompts
    skipped, verifier errors): they join that step's metrics row and are never trained on."""
    from rlax_tasks.controller import Batch, SkippedPrompt
    from tests.controller.test_buffer import group

    run_dir = str(tmp_path / "run")
    service = make_service(run_dir, None)
    seen = []
    step = service.trainer.step

    def spy(batch, *args, **kwargs):
        seen.append(sorted(batch))
        return step(batch, *args, **kwargs)

    monkeypatch.setattr(service.trainer, "step", spy)
    # what TrainerClient sends for a Batch: its arrays and its stats()
    sent = {}
    client = TrainerClient("http://127.0.0.1:9")
    monkeypatch.setattr(client, "train", lambda step, arrays: sent.update(arrays) or {"version": 1})
    skipped = (SkippedPrompt("a/0/1", "too long"), SkippedPrompt("a/0/2", "too long"))
    scored = dataclasses.replace(group("b/0/0", 0, 3), verdicts=("verifier_timeout", "correct"))
    assert client(Batch(1, (scored,), skipped=skipped)) == 1
    stats = {k: v for k, v in sent.items() if k.startswith("stat_")}
    assert stats == {"stat_prompts_skipped": 2.0, "stat_verifier_errors": 1.0}
    out = service.train(1, {**random_batch(1), **stats})
    assert seen == [sorted(random_batch(1))]  # no stat_ key reached the train step
    assert out["metrics"]["prompts_skipped"] == 2.0 and out["metrics"]["verifier_errors"] == 1.0
    (row,) = read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    assert row["step"] == 1 and row["prompts_skipped"] == 2.0 and row["verifier_errors"] == 1.0
    assert np.isfinite(row["loss"])
    service.stop()
