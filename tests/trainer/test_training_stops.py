"""Training stops cleanly, never with a traceback or a restart loop: checkpoints that cannot be
written (a full disk) stop it after ``MAX_FAILED_CHECKPOINTS`` in a row and a resume continues
from the last good one; a non-finite update is never checkpointed or pushed to the parameter
server, and the trainer service's process exits 2 (rlax's "do not restart").

One test, so that one trainer compiles its step (most of the time here); the later trainers
only restore and save."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import orbax.checkpoint as ocp
import pytest

from rlax_tasks.algorithms import make_objective
from rlax_tasks.rundir import notices
from rlax_tasks.trainer.checkpointing import MAX_FAILED_CHECKPOINTS
from rlax_tasks.trainer.config import TrainerConfig
from rlax_tasks.trainer.service import TrainerService
from rlax_tasks.trainer.trainer import (
    EXIT_DO_NOT_RESTART,
    CheckpointWriteError,
    NonFiniteError,
    Trainer,
)
from tests.trainer.helpers import random_batch, tiny_policy

CONFIG = TrainerConfig(
    learning_rate=1e-3, mesh_shape=(1, 1, 1), async_checkpointing=False, checkpoint_every=1
)


def _trainer(run_dir: str) -> Trainer:
    return Trainer(tiny_policy(), make_objective("grpo", kl_beta=0.0), CONFIG, run_dir)


class FakeParameterServer:
    """Records the versions pushed to it."""

    def __init__(self) -> None:
        self.pushed: list[int] = []

    def latest_version(self) -> int | None:
        return self.pushed[-1] if self.pushed else None

    def push(self, version: int, params) -> None:  # noqa: ANN001
        self.pushed.append(version)


class Exited(BaseException):
    """What the patched ``os._exit`` raises instead of ending the test process."""


def _posted(run_dir: str, kind: str) -> list[str]:
    return [n.message for n in notices.read_since(run_dir)[0] if n.kind == kind]


def test_a_full_disk_and_a_non_finite_update_stop_training_cleanly(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "run")
    checkpoints = os.path.join(run_dir, "checkpoints")
    ps = FakeParameterServer()
    service = TrainerService(_trainer(run_dir), ps, repush_every_s=3600).start()
    trainer = service.trainer
    service.train(1, random_batch(1))  # checkpoint 1 is written, version 1 pushed

    # ---- the disk is full for two checkpoints: training goes on, each failure is posted
    def disk_full(self, step, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", f"{checkpoints}/{step}")

    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full)
    service.train(2, random_batch(2))
    service.train(3, random_batch(3))
    warnings = _posted(run_dir, "warning")
    assert len(warnings) == 2 and f"{checkpoints}/3" in warnings[-1]
    monkeypatch.undo()  # space is back: the next checkpoint interval writes one
    service.train(4, random_batch(4))
    assert trainer.checkpointer.complete_steps() == [1, 4] and ps.pushed == [0, 1, 2, 3, 4]

    # ---- a step that makes the weights non-finite, in the service's request thread
    poisoned = random_batch(5)
    poisoned["rewards"] = np.full_like(poisoned["rewards"], np.nan)
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Exited

    monkeypatch.setattr(os, "_exit", fake_exit)
    errors: list[BaseException] = []

    def request() -> None:
        try:
            service.train(5, poisoned)
        except BaseException as e:  # noqa: BLE001 - the test looks at what ended the thread
            errors.append(e)

    thread = threading.Thread(target=request)
    thread.start()
    thread.join(timeout=600)
    assert not thread.is_alive()
    assert codes == [EXIT_DO_NOT_RESTART] and isinstance(errors[0], Exited)
    assert ps.pushed == [0, 1, 2, 3, 4]  # version 5 never reached the parameter server
    assert trainer.checkpointer.complete_steps() == [1, 4]  # nor a checkpoint
    (message,) = _posted(run_dir, "fatal")
    assert "training step 5" in message and "the loss" in message
    assert "trainer.learning_rate" in message and "step 4" in message
    # in the main thread (a colocated run) the same stop is raised: `rlax` exits 2 with it
    with pytest.raises(NonFiniteError) as raised:
        service.train(5, random_batch(5))
    assert isinstance(raised.value, ValueError)
    with pytest.raises(NonFiniteError):
        trainer.policy()
    trainer.save()  # refused quietly: nothing is committed once training stopped
    assert trainer.checkpointer.complete_steps() == [1, 4]
    monkeypatch.undo()

    # ---- a disk that stays full: the bounded count of failed checkpoints stops training
    second = _trainer(run_dir)
    assert second.restore_latest().step == 4
    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full)
    for _ in range(MAX_FAILED_CHECKPOINTS - 1):
        second.save()
    with pytest.raises(CheckpointWriteError) as stopped:
        second.save()
    assert isinstance(stopped.value, ValueError)  # one line, exit 2
    fatal = _posted(run_dir, "fatal")[-1]
    assert f"{checkpoints}/4" in fatal and "No space left on device (ENOSPC)" in fatal
    assert "step 4" in fatal and "run the same command again" in fatal
    with pytest.raises(CheckpointWriteError):  # stopped for good
        second.step(random_batch(6))
    second.close()
    monkeypatch.undo()

    # ---- space is back: a resume starts from the last good checkpoint and checkpoints again
    third = _trainer(run_dir)
    assert third.restore_latest().step == 4
    assert third.checkpointer.complete_steps() == [1, 4]
    third.close()


def test_the_step_flags_each_non_finite_quantity_in_one_scalar():
    import jax.numpy as jnp

    from rlax_tasks.trainer.train_step import NONFINITE_BITS, nonfinite_code

    finite = {"model": {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)}}
    overflowed = {"model": {"w": jnp.ones((3, 4)).at[1, 2].set(jnp.inf), "b": jnp.zeros(4)}}
    one = jnp.asarray(1.0)
    assert int(nonfinite_code(one, one, finite)) == 0
    assert int(nonfinite_code(one, one, overflowed)) == NONFINITE_BITS["updated weights"]
    assert int(nonfinite_code(jnp.asarray(jnp.nan), one, finite)) == NONFINITE_BITS["loss"]
    assert int(nonfinite_code(one, jnp.asarray(jnp.inf), finite)) == NONFINITE_BITS["gradient norm"]
