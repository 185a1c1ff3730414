"""Checkpoints count only when their data verifies: a missing or truncated array file is caught by
the manifest (or, for a checkpoint written before manifests, by reading it), the damaged
checkpoint is set aside (renamed, never deleted) and the newest older one restored. A save the
storage refuses is counted, not raised, and the next one is tried again."""

from __future__ import annotations

import errno
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rlax_tasks.rundir import storage
from rlax_tasks.trainer import Checkpointer, is_complete_checkpoint
from rlax_tasks.trainer.checkpointing import MANIFEST_FILE
from tests.trainer.helpers import abstract, small_state

# a restore that fails on a damaged file leaves Orbax's reader coroutine to the garbage collector
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _saved(directory: str, steps=(1, 2, 3)) -> None:
    ckpt = Checkpointer(directory, max_to_keep=10)
    for step in steps:
        ckpt.save(step, small_state(step), {"step": step})
    ckpt.close()


def _array_files(step_dir: str) -> list[str]:
    """The files holding the arrays' bytes (the OCDBT data files the merged database reads)."""
    files = [p for p in storage.list_prefix(step_dir) if "/state/d/" in p]
    assert files, storage.list_prefix(step_dir)
    return files


def _damage(path: str, how: str) -> None:
    if how == "missing":
        storage.delete_prefix(path)
    else:  # truncated
        data = storage.read_bytes(path)
        storage.write_bytes(path, data[: len(data) // 2])


def _assert_restores_step_2(ckpt: Checkpointer) -> None:
    step, state, meta = ckpt.restore_latest(abstract(small_state(0)))
    assert (step, meta) == (2, {"step": 2})
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(small_state(2)["w"]))


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_a_checkpoint_with_a_damaged_array_file_is_set_aside_and_the_previous_restored(
    tmp_path, how
):
    directory = str(tmp_path / "checkpoints")
    _saved(directory)
    newest = os.path.join(directory, "3")
    assert os.path.exists(os.path.join(newest, MANIFEST_FILE))  # written inside the commit
    assert is_complete_checkpoint(newest)
    damaged = _array_files(newest)[-1]
    _damage(damaged, how)
    assert not is_complete_checkpoint(newest)  # the manifest catches it without reading

    ckpt = Checkpointer(directory, max_to_keep=10)
    assert ckpt.complete_steps() == [1, 2]
    (aside,) = ckpt.set_aside
    assert aside.step == 3 and os.path.relpath(damaged, newest) in aside.reason
    assert os.path.basename(aside.path).startswith("3.damaged-")
    assert os.path.isdir(aside.path) and not os.path.exists(newest)  # renamed, not deleted
    _assert_restores_step_2(ckpt)
    ckpt.save(3, small_state(3), {"step": 3})  # the run goes on past it
    ckpt.wait()
    assert ckpt.complete_steps() == [1, 2, 3] and ckpt.failures == 0
    ckpt.close()


def test_a_checkpoint_without_a_manifest_is_checked_by_reading_it(tmp_path):
    """Written before manifests existed: its missing file shows when it is restored."""
    directory = str(tmp_path / "checkpoints")
    _saved(directory)
    newest = os.path.join(directory, "3")
    os.remove(os.path.join(newest, MANIFEST_FILE))
    _damage(_array_files(newest)[-1], "missing")
    ckpt = Checkpointer(directory, max_to_keep=10)
    assert ckpt.complete_steps() == [1, 2, 3]  # nothing to compare sizes against
    _assert_restores_step_2(ckpt)
    (aside,) = ckpt.set_aside
    assert aside.step == 3 and "cannot be read" in aside.reason and "NOT_FOUND" in aside.reason
    assert ckpt.complete_steps() == [1, 2]
    ckpt.close()


def test_a_restore_that_does_not_fit_the_model_is_an_error_not_damage(tmp_path):
    directory = str(tmp_path / "checkpoints")
    _saved(directory, steps=(1,))
    ckpt = Checkpointer(directory, max_to_keep=10)
    wrong = {"w": jax.ShapeDtypeStruct((5, 8), jnp.float32), "n": abstract(small_state(0))["n"]}
    with pytest.raises(ValueError, match="shape"):
        ckpt.restore_latest(wrong)
    assert ckpt.set_aside == [] and sorted(os.listdir(directory)) == ["1"]
    ckpt.close()


def test_a_damaged_checkpoint_is_set_aside_on_gcs(gcs_bucket):
    directory = storage.join(gcs_bucket, "runs", "verify", "checkpoints")
    _saved(directory, steps=(2, 3))
    newest = storage.join(directory, "3")
    assert storage.exists(storage.join(newest, MANIFEST_FILE))
    _damage(_array_files(newest)[-1], "truncated")
    ckpt = Checkpointer(directory, max_to_keep=10)
    (aside,) = ckpt.set_aside
    assert storage.list_prefix(newest) == []  # copied to the new name, then removed
    assert storage.list_prefix(aside.path)  # all there under the new name
    _assert_restores_step_2(ckpt)
    ckpt.close()


def test_a_checkpoint_the_storage_refuses_is_counted_and_the_next_one_tried(tmp_path, monkeypatch):
    directory = str(tmp_path / "checkpoints")
    ckpt = Checkpointer(directory, max_to_keep=10)
    ckpt.save(1, small_state(1), {"step": 1})
    ckpt.wait()
    real_save, real_wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished

    def disk_full(self, step, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", f"{directory}/{step}")

    monkeypatch.setattr(ocp.CheckpointManager, "save", disk_full)
    ckpt.save(2, small_state(2), {"step": 2})  # refused while starting: counted, not raised
    assert ckpt.failures == 1 and ckpt.last_failure.step == 2
    assert ckpt.last_failure.error == "No space left on device (ENOSPC)"

    # refused in the background: TensorStore's error surfaces when the save is waited for
    monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
    failing = iter([False, True])  # the wait before the save, then the wait for it

    def background_failure(self):
        real_wait(self)
        if next(failing, False):
            raise ValueError(
                f'OUT_OF_RANGE: Failed writing: "{directory}/3/state/d/x" [os_error_code=28]'
            )

    monkeypatch.setattr(ocp.CheckpointManager, "wait_until_finished", background_failure)
    ckpt.save(3, small_state(3), {"step": 3})
    ckpt.wait()
    assert ckpt.failures == 2 and ckpt.last_failure.step == 3
    assert "ENOSPC" in ckpt.last_failure.error
    assert ckpt.last_good_step == 1

    ckpt.save(4, small_state(4), {"step": 4})  # space is back: the next interval succeeds
    ckpt.wait()
    assert ckpt.failures == 0 and ckpt.last_failure is None and ckpt.last_good_step == 4
    assert 4 in ckpt.complete_steps()
    ckpt.close()
