"""lineage.jsonl: one record per step, idempotent on resume, truncated last line tolerated."""

from __future__ import annotations

import pytest

from rlax_tasks.controller import (
    Batch,
    DroppedGroup,
    LineageWriter,
    SkippedPrompt,
    lineage_record,
    read_lineage,
)
from rlax_tasks.rundir import storage
from tests.controller.test_buffer import group
from tests.paramserver.helpers import gcs_emulator


def record(step: int) -> dict:
    batch = Batch(
        step,
        (group(f"a/0/{step}", step - 1, step), group(f"b/0/{step}", step - 2, step + 100)),
        (DroppedGroup("old", 0, "stale"), DroppedGroup("z", step - 1, "zero_variance")),
        (SkippedPrompt("long/0/9", "prompt has 900 tokens, more than 384"),),
    )
    return lineage_record(step, batch)


def test_record_fields():
    r = record(3)
    assert r == {
        "step": 3,
        "version": 3,
        "prompt_ids": ["a/0/3", "b/0/3"],
        "rollout_versions": [2, 1],
        "token_versions": [[[2, 3]], [[1, 3]]],  # per group, [version, tokens] (3 tokens each)
        "dropped_stale": [{"prompt_id": "old", "version": 0}],
        "dropped_zero_variance": [{"prompt_id": "z", "version": 2}],
        "skipped_prompts": [
            {"prompt_id": "long/0/9", "reason": "prompt has 900 tokens, more than 384"}
        ],
    }


def test_idempotent_and_truncated_last_line(tmp_path):
    run = str(tmp_path)
    w = LineageWriter(run)
    assert w.append(record(1)) and w.append(record(2))
    assert not w.append(record(2))  # already recorded
    path = storage.join(run, "lineage.jsonl")
    with open(path, "ab") as fh:
        fh.write(b'{"step": 3, "version"')  # killed mid-write
    assert [r["step"] for r in read_lineage(run)] == [1, 2]
    resumed = LineageWriter(run)
    assert not resumed.append(record(1))
    assert resumed.append(record(3))
    assert read_lineage(run) == [record(1), record(2), record(3)]
    assert storage.read_bytes(path).count(b"\n") == 3


def test_corrupt_middle_line_is_an_error(tmp_path):
    path = tmp_path / "lineage.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2"):
        LineageWriter(str(tmp_path))


def test_on_gcs():
    with gcs_emulator("lineage-test") as bucket:
        run = storage.join(bucket, "run")
        w = LineageWriter(run)
        w.append(record(1))
        w.append(record(2))
        assert not LineageWriter(run).append(record(2))
        assert read_lineage(run) == [record(1), record(2)]
