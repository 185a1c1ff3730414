"""`rlax colocated` end to end over damaged state: the newest snapshot and the newest checkpoint
of a finished run are cut short; the same command with more steps sets both aside (renamed, not
deleted), falls back to the newest ones that verify, and trains every step exactly once."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from rlax_tasks.config import save_resolved
from rlax_tasks.rundir import notices
from tests.run.test_colocated import COLOCATED, _env
from tests.run.test_local_run import read_jsonl, small_config


def _colocated(config_path: str, steps: int, log_path: str) -> None:
    with open(log_path, "ab") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "rlax_tasks.cli", "colocated", "--config", config_path,
             "--steps", str(steps)],
            stdout=log, stderr=log, env=_env(), timeout=600,
        )  # fmt: skip
    assert proc.returncode == 0, open(log_path).read()[-3000:]


def _cut_short(path: str) -> None:
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


@pytest.mark.slow
def test_a_damaged_newest_snapshot_and_checkpoint_fall_back_and_every_step_trains_once(tmp_path):
    cfg = small_config(tmp_path, run_id="damaged", **COLOCATED)  # checkpoints every 2 steps
    path, run_dir, log = save_resolved(cfg), cfg.run_dir, str(tmp_path / "run.log")
    _colocated(path, 4, log)
    _cut_short(os.path.join(run_dir, "snapshots", "4.json"))  # what LATEST names
    _cut_short(sorted(glob.glob(os.path.join(run_dir, "checkpoints", "4", "state", "d", "*")))[0])

    _colocated(path, 6, log)  # the same command, more steps
    lineage = read_jsonl(os.path.join(run_dir, "lineage.jsonl"))
    assert [r["step"] for r in lineage] == [1, 2, 3, 4, 5, 6]  # each step once, contiguous
    metrics = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert [r["step"] for r in metrics] == [1, 2, 3, 4, 5, 6]
    # set aside, not deleted: the damaged bytes are still there under the new names
    (snapshot,) = glob.glob(os.path.join(run_dir, "snapshots", "4.json.damaged-*"))
    (checkpoint,) = glob.glob(os.path.join(run_dir, "checkpoints", "4.damaged-*"))
    assert os.path.getsize(snapshot) > 0 and glob.glob(os.path.join(checkpoint, "state", "d", "*"))
    fallbacks = [n for n in notices.read_since(run_dir)[0] if n.kind == "fallback"]
    assert sorted(n.source for n in fallbacks) == ["controller", "trainer"]
    assert "restored the newest intact one, step 2" in " ".join(n.message for n in fallbacks)
