"""Trainer state on a gs:// run directory (GCS emulator): Orbax checkpoints through gcsfs and
TensorStore, and metrics.jsonl that the dashboard reads."""

from __future__ import annotations

import gc
import json
import time

import jax
import numpy as np
import pytest

from rlax_tasks.rundir import storage
from rlax_tasks.trainer import Checkpointer, MetricsWriter, read_metrics
from tests.compute.helpers import wait_for
from tests.trainer.helpers import abstract, small_state


@pytest.fixture
def run_dir(gcs_bucket, request):
    return storage.join(gcs_bucket, "runs", request.node.name)


# --------------------------------------------------------------------------- checkpoints
def test_orbax_checkpoints_on_gcs_save_restore_and_skip_incomplete(run_dir):
    directory = storage.join(run_dir, "checkpoints")
    ckpt = Checkpointer(directory, max_to_keep=2, async_save=True)
    assert ckpt.latest_step() is None  # an empty prefix: nothing yet, no error
    for step in (1, 2, 3):
        ckpt.save(step, small_state(step), {"step": step, "cursor": step * 10})
    ckpt.wait()
    assert ckpt.complete_steps() == [2, 3]  # max_to_keep pruned step 1
    objects = storage.list_prefix(directory)
    assert any(p.startswith(f"{directory}/3/state/") for p in objects)  # TensorStore's arrays
    assert f"{directory}/3/meta/metadata" in objects
    ckpt.close()

    # a copy of step 3 that never committed (no commit_success.txt, Orbax's marker on GCS)
    for path in storage.list_prefix(storage.join(directory, "3")):
        if not path.endswith("commit_success.txt"):
            copy = path.replace(f"{directory}/3/", f"{directory}/4/")
            storage.write_bytes(copy, storage.read_bytes(path))
    reopened = Checkpointer(directory, max_to_keep=2)  # a restarted trainer
    assert reopened.complete_steps() == [2, 3]
    assert storage.list_prefix(storage.join(directory, "4")) == []  # the debris was removed
    step, state, meta = reopened.restore_latest(abstract(small_state(0)))
    assert (step, meta) == (3, {"step": 3, "cursor": 30})
    np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(small_state(3)["w"]))
    assert int(state["n"]) == 3
    reopened.close()


def test_a_trainer_with_a_gcs_run_dir_checkpoints_and_writes_metrics(run_dir):
    from rlax_tasks.algorithms import make_objective
    from rlax_tasks.trainer import Trainer, TrainerConfig
    from tests.trainer.helpers import tiny_policy

    # no optimizer step (compiling one takes most of a minute here): a save of the initial
    # state exercises the same Orbax path as the automatic checkpoint every checkpoint_every
    config = TrainerConfig(learning_rate=1e-3, total_steps=10, mesh_shape=(1, 2, 2))
    trainer = Trainer(tiny_policy(seed=0), make_objective("grpo"), config, run_dir)
    assert trainer.restore_latest() is None
    trainer.step_count = 7
    trainer.save({"next": 8})
    trainer.metrics_writer.write(7, {"loss": 0.5})  # what step() does after each update
    trainer.wait_for_checkpoint()
    trainer.metrics_writer.close()  # a clean stop writes the last rows
    trainer.close()
    assert read_metrics(storage.join(run_dir, "metrics.jsonl")) == [{"step": 7, "loss": 0.5}]

    resumed = Trainer(tiny_policy(seed=1), make_objective("grpo"), config, run_dir)
    restored = resumed.restore_latest()
    assert (restored.step, restored.data_cursor) == (7, {"next": 8})
    for a, b in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(trainer.params), strict=True):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # seed 0's, not seed 1's
    resumed.metrics_writer.write(8, {"loss": 0.25})
    resumed.metrics_writer.close()
    resumed.close()
    assert [r["step"] for r in read_metrics(storage.join(run_dir, "metrics.jsonl"))] == [7, 8]


# --------------------------------------------------------------------------- metrics
def test_gcs_metrics_cost_no_request_per_step_and_are_complete_at_close(run_dir, monkeypatch):
    path = storage.join(run_dir, "metrics.jsonl")
    uploads = []
    real_write = storage.write_bytes

    def counting_write(p: str, data: bytes) -> None:
        uploads.append(p)
        real_write(p, data)

    monkeypatch.setattr(storage, "write_bytes", counting_write)
    writer = MetricsWriter(path, flush_every_s=3600.0)
    for step in range(1, 201):
        writer.write(step, {"loss": 1.0 / step, "reward_mean": step / 200})
    assert uploads == []  # steps only append in memory
    writer.close()
    assert uploads == [path]  # one upload at the clean stop, with every row
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == list(range(1, 201))
    assert rows[-1] == {"step": 200, "loss": 1.0 / 200, "reward_mean": 1.0}


def test_gcs_metrics_upload_in_the_background_and_resume_after_a_restart(run_dir):
    path = storage.join(run_dir, "metrics.jsonl")
    writer = MetricsWriter(path, flush_every_s=0.05)
    writer.write(1, {"loss": 0.5, "nan": float("nan")})
    writer.write(2, {"loss": 0.25})
    # no flush, no close: the background upload brings the rows within flush_every_s
    wait_for(lambda: storage.exists(path) and len(read_metrics(path)) == 2, timeout_s=10.0)
    assert read_metrics(path) == [{"step": 1, "loss": 0.5, "nan": None}, {"step": 2, "loss": 0.25}]
    writer.close()

    # a crash can leave nothing torn on GCS, but a hand-edited object might: the row is dropped
    storage.write_bytes(path, storage.read_bytes(path) + b'{"step": 3, "lo')
    again = MetricsWriter(path, flush_every_s=3600.0)  # a restarted trainer replaying step 2
    again.write(2, {"loss": 9.0})
    again.write(3, {"loss": 0.125})
    del again  # dropped without close (e.g. at interpreter exit): the finalizer uploads
    gc.collect()
    assert [r["loss"] for r in read_metrics(path)] == [0.5, 0.25, 0.125]


def test_the_dashboard_shows_a_gcs_run(gcs_bucket):
    from rlax_dashboard.runs import list_runs, read_series

    root = storage.join(gcs_bucket, "dashboard-root")
    run = storage.join(root, "gcs-run")
    storage.write_bytes(storage.join(run, "config.yaml"), b"run_id: gcs-run\n")
    with MetricsWriter(storage.join(run, "metrics.jsonl")) as writer:
        for step in (1, 2, 3):
            writer.write(step, {"loss": 0.1, "reward_mean": 0.25 * step})
    (summary,) = list_runs([root])
    assert (summary.run_id, summary.step, summary.reward_mean) == ("gcs-run", 3, 0.75)
    assert summary.state == "running" and time.time() - summary.updated < 60
    assert read_series(run).reward == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert json.loads(storage.read_bytes(storage.join(run, "metrics.jsonl")).splitlines()[0]) == {
        "step": 1, "loss": 0.1, "reward_mean": 0.25
    }  # fmt: skip
