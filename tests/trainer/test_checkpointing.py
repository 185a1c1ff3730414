"""Orbax checkpoints: bitwise resume in a new process, incomplete checkpoints never restored."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tasks.algorithms import make_objective
from rlax_tasks.trainer import Checkpointer, Trainer, TrainerConfig, read_metrics
from tests.trainer._resume_worker import RESUME_CONFIG
from tests.trainer.helpers import abstract, random_batch, small_state, tiny_policy

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_resume_worker.py")

needs_4_devices = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (forced) devices")


def _run_worker(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, WORKER, *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
@needs_4_devices
def test_resume_in_a_new_process_is_bitwise_identical(tmp_path):
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    config = TrainerConfig(**RESUME_CONFIG, checkpoint_every=1, max_to_keep=3)
    trainer = Trainer(tiny_policy(), make_objective("grpo"), config, str(straight_dir))
    assert trainer.restore_latest() is None  # nothing to resume yet
    for step in range(4):
        trainer.step(random_batch(step), data_cursor={"next_batch": step + 1})
    trainer.wait_for_checkpoint()
    straight = {
        jax.tree_util.keystr(k): np.asarray(v)
        for k, v in jax.tree_util.tree_leaves_with_path(trainer.params)
    }
    straight_rng = np.asarray(jax.random.key_data(trainer.rng))
    # checkpoint_every=1 saved every step; max_to_keep=3 pruned step 1
    assert trainer.checkpointer.complete_steps() == [2, 3, 4]
    assert sorted(os.listdir(straight_dir / "checkpoints")) == ["2", "3", "4"]
    trainer.close()

    # a fresh run directory holding only the step-2 checkpoint; resume there in a new process
    shutil.copytree(straight_dir / "checkpoints" / "2", resumed_dir / "checkpoints" / "2")
    out = str(tmp_path / "resumed.npz")
    proc = _run_worker("resume", str(resumed_dir), out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out + ".json") as fh:
        info = json.load(fh)
    assert info == {"step": 2, "cursor": {"next_batch": 2}}
    resumed = dict(np.load(out))
    np.testing.assert_array_equal(resumed.pop("__rng__"), straight_rng)
    assert resumed.keys() == straight.keys()
    for k in straight:
        assert resumed[k].dtype == np.float32
        np.testing.assert_array_equal(resumed[k], straight[k], err_msg=k)  # bitwise

    # metrics.jsonl: one record per step, and the resumed steps reproduce the straight ones
    first = read_metrics(str(straight_dir / "metrics.jsonl"))
    second = read_metrics(str(resumed_dir / "metrics.jsonl"))
    assert [r["step"] for r in first] == [1, 2, 3, 4]
    assert [r["step"] for r in second] == [3, 4]
    for a, b in zip(first[2:], second, strict=True):
        for key in ("loss", "grad_norm", "entropy", "lr", "logprob_mismatch_p95", "kl"):
            assert a[key] == b[key], key


def test_incomplete_checkpoints_are_never_chosen(tmp_path):
    directory = tmp_path / "checkpoints"
    ckpt = Checkpointer(str(directory), max_to_keep=10)
    for step in (1, 2):
        ckpt.save(step, small_state(step), {"step": step})
    ckpt.close()
    # what crashes leave behind: a step dir with partial contents, copies missing the commit
    # metadata or an item's metadata, an Orbax temporary directory
    (directory / "3" / "state").mkdir(parents=True)
    (directory / "3" / "state" / "partial.bin").write_bytes(b"\0" * 100)
    shutil.copytree(directory / "2", directory / "4")
    os.remove(directory / "4" / "_CHECKPOINT_METADATA")
    shutil.copytree(directory / "2", directory / "5")
    os.remove(directory / "5" / "state" / "_METADATA")
    shutil.copytree(directory / "2", directory / "6.orbax-checkpoint-tmp-1234567")

    reopened = Checkpointer(str(directory), max_to_keep=10)
    assert reopened.complete_steps() == [1, 2]
    step, state, meta = reopened.restore_latest(abstract(small_state(0)))
    assert (step, meta) == (2, {"step": 2})
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(small_state(2)["w"]))
    # the debris is gone and finalized directories that do not verify were set aside (renamed,
    # never deleted), so the next save of step 3 works and becomes the latest
    names = sorted(os.listdir(directory))
    assert [n for n in names if ".damaged-" not in n] == ["1", "2"]
    assert sorted(n.split(".damaged-")[0] for n in names if ".damaged-" in n) == ["3", "4", "5"]
    reopened.save(3, small_state(3), {"step": 3})
    reopened.wait()
    assert reopened.latest_step() == 3
    with pytest.raises(FileNotFoundError, match="no complete checkpoint of step 7"):
        reopened.restore(7, abstract(small_state(0)))
    reopened.close()


def test_a_relative_directory_saves_and_restores(tmp_path, monkeypatch):
    """A relative run_root (``rlax run --run-root runs``) gives a relative checkpoint directory."""
    monkeypatch.chdir(tmp_path)
    ckpt = Checkpointer(os.path.join("runs", "r1", "checkpoints"), max_to_keep=2)
    ckpt.save(1, small_state(1), {"step": 1})
    ckpt.wait()
    assert ckpt.complete_steps() == [1]
    step, state, _ = ckpt.restore_latest(abstract(small_state(0)))
    ckpt.close()
    assert step == 1 and (tmp_path / "runs" / "r1" / "checkpoints" / "1").is_dir()
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(small_state(1)["w"]))


@pytest.mark.slow
def test_a_save_killed_midway_is_skipped(tmp_path):
    directory = tmp_path / "checkpoints"
    proc = _run_worker("die-mid-save", str(directory))
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
    leftovers = sorted(os.listdir(directory))
    assert "1" in leftovers and "2" not in leftovers, leftovers  # step 2 never committed

    ckpt = Checkpointer(str(directory))
    assert ckpt.latest_step() == 1
    step, state, meta = ckpt.restore_latest({"w": jax.ShapeDtypeStruct((64,), jnp.float32)})
    assert (step, meta) == (1, {"step": 1})
    want = np.random.default_rng(0).standard_normal((64,), np.float32)
    np.testing.assert_array_equal(np.asarray(state["w"]), want)
    assert sorted(os.listdir(directory)) == ["1"]  # the temporary step-2 directory was removed
    ckpt.close()


def test_fresh_copy_gives_new_buffers_and_compiles_its_copy_once():
    # a checkpoint's private copy of the train state: equal values in buffers of its own (the
    # next step donates the originals), made by one jitted copy per state layout
    from rlax_tasks.trainer.trainer import _copier, fresh_copy

    state = {"w": jnp.arange(6.0).reshape(2, 3), "step": jnp.asarray(3, jnp.int32)}
    shardings = jax.tree.map(lambda a: a.sharding, state)
    first = fresh_copy(state, shardings)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(first), strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
    misses = _copier.cache_info().misses
    fresh_copy(first, shardings)
    fresh_copy(state, shardings)
    assert _copier.cache_info().misses == misses  # the same layout reuses its copy
