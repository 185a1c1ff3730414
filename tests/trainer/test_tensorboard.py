"""TensorBoard events of a run (docs/design.md §7, tb/): the same values as metrics.jsonl, read back
with TensorBoard's own event reader; a replayed step adds no point; evaluations under tb/eval."""

from __future__ import annotations

import glob
import json
import os

import pytest

from rlax_tasks.rundir.paths import run_paths
from rlax_tasks.trainer import MetricsWriter, read_metrics
from rlax_tasks.trainer.scalar_export import log_scalars
from tests.compute.helpers import wait_for


def _scalars(directory: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar point in ``directory``'s event files (no sampling, no purging), by tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(directory, size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    # by step: a restarted writer's event file may sort before the first one (both named
    # after the same second), and TensorBoard plots by step whatever the file order
    return {
        tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]
    }


def _lineage(run_dir: str, step: int, rollout_versions: list[int], dropped: int) -> None:
    with open(run_paths(run_dir).lineage, "a") as f:
        row = {"step": step, "version": step, "rollout_versions": rollout_versions,
               "dropped_stale": ["p"] * dropped, "dropped_zero_variance": []}  # fmt: skip
        f.write(json.dumps(row) + "\n")


def test_metrics_writer_writes_the_same_values_as_tensorboard_events(tmp_path):
    run_dir = str(tmp_path / "run")
    path = run_paths(run_dir).metrics
    writer = MetricsWriter(path)
    rows = {
        1: {"loss": 0.5, "reward_mean": 0.25, "objective/clip_frac": 0.0, "nan": float("nan")},
        2: {"loss": 0.25, "reward_mean": 0.5, "objective/clip_frac": 0.125, "tokens": 64},
        3: {"loss": 0.125, "reward_mean": 0.75, "objective/clip_frac": 0.25, "time": 1.8e9},
    }
    for step, metrics in rows.items():
        writer.write(step, metrics)
        _lineage(run_dir, step, [step - 1, step - 2], dropped=step)  # the controller, after
    writer.write(2, {"loss": 9.0, "reward_mean": 9.0})  # a replayed step keeps its first row
    writer.close()
    again = MetricsWriter(path)  # the trainer restarted from an older checkpoint
    again.write(3, {"loss": 9.0})
    again.write(4, {"loss": 0.0625, "reward_mean": 1.0})
    again.close()

    events = _scalars(os.path.join(run_paths(run_dir).tb, "train"))
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [
        (1, 0.5), (2, 0.25), (3, 0.125), (4, 0.0625),
    ]  # fmt: skip
    # each step once, with its first row's values (binary fractions: exact in float32)
    assert events["loss"] == [(1, 0.5), (2, 0.25), (3, 0.125), (4, 0.0625)]
    assert events["reward_mean"] == [(1, 0.25), (2, 0.5), (3, 0.75), (4, 1.0)]
    assert events["objective/clip_frac"] == [(1, 0.0), (2, 0.125), (3, 0.25)]
    assert events["tokens"] == [(2, 64.0)]
    assert "nan" not in events and "time" not in events and "step" not in events
    # each step's lineage with the next step (the controller writes it after the step)
    assert events["staleness/mean"] == [(1, 1.5), (2, 1.5), (3, 1.5)]
    assert events["staleness/max"] == [(1, 2.0), (2, 2.0), (3, 2.0)]
    assert events["dropped/stale"] == [(1, 1.0), (2, 2.0), (3, 3.0)]


def test_evaluations_go_to_tb_eval_once_per_group_and_step(tmp_path):
    from rlax_tasks.run.progress import HeldOutProgress

    run_dir = str(tmp_path)
    progress = HeldOutProgress(run_dir, 0.0)
    progress.record(0, {"version": 0, "pass@1": 0.25, "pass@8": 0.5, "mean_reward": 0.2})
    progress.record(5, {"version": 5, "pass@1": 0.5, "pass@8": 0.75, "mean_reward": 0.4})
    assert log_scalars(run_dir, 5, {"pass@1": 0.625}, "eval")
    assert not log_scalars(run_dir, 5, {"pass@1": 0.9}, "eval")  # evaluated again: no new point
    events = _scalars(os.path.join(run_paths(run_dir).tb, "eval"))
    assert events["heldout/pass@1"] == [(0, 0.25), (5, 0.5)]
    assert events["heldout/pass@8"] == [(0, 0.5), (5, 0.75)]
    assert events["eval/pass@1"] == [(5, 0.625)]
    assert "heldout/version" not in events and "heldout/seconds" not in events


def _wandb_history(path: str) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of the history records in an offline W&B run file (.wandb: a
    7-byte header, then LevelDB-log records in 32 KiB blocks, each a ``Record`` protobuf)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    block, pos, pending, history = 32768, 7, b"", {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = {
                    i.key or "/".join(i.nested_key): i.number if i.HasField("number")
                    else json.loads(i.value_json or "null")
                    for i in record.history.item
                }  # fmt: skip
                history[record.history.step.num] = items
    return history


def test_wandb_gets_the_training_scalars_when_configured(tmp_path, monkeypatch):
    """Offline (no network): the W&B run named after the run id records every step's values.
    wandb is a test dependency (the [test] extra), so this runs wherever the tests do."""
    monkeypatch.setenv("WANDB_PROJECT", "rlax-test")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = str(tmp_path / "my-run")
    writer = MetricsWriter(run_paths(run_dir).metrics)
    writer.write(1, {"loss": 0.5, "reward_mean": 0.25})
    writer.write(2, {"loss": 0.25, "reward_mean": 0.5})
    writer.close()
    pattern = str(tmp_path / "wandb-dir" / "wandb" / "offline-run-*-my-run" / "*.wandb")
    (path,) = wait_for(lambda: glob.glob(pattern))
    # W&B's service finishes writing the run file shortly after finish() returns
    history = wait_for(lambda: len(h := _wandb_history(path)) == 2 and h, timeout_s=60)
    assert {s: {k: history[s][k] for k in ("loss", "reward_mean")} for s in history} == {
        1: {"loss": 0.5, "reward_mean": 0.25},
        2: {"loss": 0.25, "reward_mean": 0.5},
    }


@pytest.mark.parametrize("size", [0, 1, 12, 4096])
def test_records_are_framed_as_tensorboards_record_writer_frames_them(tmp_path, size):
    from tensorboard.summary.writer.record_writer import RecordWriter

    from rlax_tasks.trainer.scalar_export import tf_record

    data = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    with open(tmp_path / "theirs", "wb") as f:
        RecordWriter(f).write(data)
    assert tf_record(data) == (tmp_path / "theirs").read_bytes()
