"""The held-out job's results file (eval/heldout_scores.jsonl) under a local or a gs:// run
directory: the job on a TPU VM appends, `rlax run`'s supervisor on another machine reads the rows
new since its last read, a line still being written waits for the next read; on gs:// also the
run's trained step and the per-step held-out curve (eval/progress.jsonl)."""

from __future__ import annotations

import json

import pytest

from rlax_tasks.run.heldout import append_row, is_result, read_scores, scores_offset
from rlax_tasks.run.progress import TAIL_BYTES, HeldOutProgress, trained_step
from rlax_tasks.rundir import storage
from rlax_tasks.rundir.paths import run_paths
from tests.paramserver.helpers import gcs_emulator


def _roundtrip(run_dir: str) -> None:
    assert scores_offset(run_dir) == 0 and read_scores(run_dir) == ([], 0)
    append_row(run_dir, {"evaluating": 0, "time": 1.0})
    append_row(run_dir, {"version": 0, "pass@1": 0.25})
    rows, offset = read_scores(run_dir)
    assert rows == [{"evaluating": 0, "time": 1.0}, {"version": 0, "pass@1": 0.25}]
    assert [is_result(r) for r in rows] == [False, True]
    assert offset == scores_offset(run_dir) > 0
    # a job started now: its rows begin at the end; a torn last line is left for later
    path = run_paths(run_dir).heldout_scores
    storage.write_bytes(path, storage.read_bytes(path) + b'{"version": 2, "pass@1"')
    assert read_scores(run_dir, offset) == ([], offset)
    storage.write_bytes(path, storage.read_bytes(path) + b": 0.5}\n")
    append_row(run_dir, {"version": 4, "pass@1": 0.75})
    rows, end = read_scores(run_dir, offset)
    assert rows == [{"version": 2, "pass@1": 0.5}, {"version": 4, "pass@1": 0.75}]
    assert end == scores_offset(run_dir)


def test_local_run_directory(tmp_path) -> None:
    _roundtrip(str(tmp_path / "run"))


@pytest.mark.timeout(120)
def test_gcs_run_directory() -> None:
    with gcs_emulator("rlax-heldout") as bucket:
        run_dir = f"{bucket}/runs/r1"
        _roundtrip(run_dir)
        assert storage.exists(f"{run_dir}/eval/heldout_scores.jsonl")
        # how far the run is (a resumed job's --after), and the per-step curve the report plots
        rows = [{"step": s, "time": 100.0 + s} for s in range(1, 5000)]
        metrics = "".join(json.dumps(r) + "\n" for r in rows).encode()
        storage.write_bytes(f"{run_dir}/metrics.jsonl", metrics)
        assert len(metrics) > TAIL_BYTES and trained_step(run_dir) == 4999
        progress = HeldOutProgress(run_dir, t0=100.0)
        progress.record_result({"version": 4, "pass@1": 0.75, "seconds": 2.0})
        progress.record_result({"version": 4, "pass@1": 0.75, "seconds": 2.0})  # once a version
        (row,) = storage.read_jsonl(f"{run_dir}/eval/progress.jsonl")
        assert row["step"] == 4 and row["seconds"] == 4.0 and row["pass@1"] == 0.75
