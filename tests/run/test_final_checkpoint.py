"""A disaggregated `rlax run` ends with the checkpoint of its last step, written by the trainer
when `rlax run` stops it (a SIGTERM), past the last periodic one; `rlax export` then writes that
step, with the weights the run published last."""

from __future__ import annotations

import os

import numpy as np
import pytest

from rlax_tasks.cli import main
from rlax_tasks.evaluation.checkpoints import load_model, mirror_arrays
from rlax_tasks.rundir.paths import run_paths
from rlax_tasks.trainer.checkpointing import is_complete_checkpoint
from tests.conftest import TEST_XLA_FLAGS
from tests.tiny_model import save_char_model

pytestmark = pytest.mark.slow

STEPS = 3
EVERY = 2  # a periodic checkpoint before the last step: the export must not settle for it


def test_a_disaggregated_run_ends_with_its_last_steps_checkpoint(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)  # the components need one device each
    model = str(tmp_path / "model")
    save_char_model(model)
    run_dir = str(tmp_path / "runs" / "d")
    code = main(
        ["run", "--preset", "tiny-arith", "--steps", str(STEPS), "--no-eval",
         "--run-root", str(tmp_path / "runs"), "--run-id", "d",
         "--set", "placement.mode=disaggregated", "--set", f"model.path={model}",
         "--set", "model.warmup_if_missing=false", "--set", "rollout.prompts_per_step=4",
         "--set", "rollout.group_size=4", "--set", "workers.slots=16",
         "--set", f"trainer.checkpoint_every={EVERY}", "--set", "eval.every_steps=0"]
    )  # fmt: skip
    assert code == 0, capsys.readouterr().err[-3000:]
    checkpoints = run_paths(run_dir).checkpoints
    assert sorted(int(s) for s in os.listdir(checkpoints)) == [EVERY, STEPS]
    assert is_complete_checkpoint(os.path.join(checkpoints, str(STEPS)))
    capsys.readouterr()

    out = str(tmp_path / "export")
    assert main(["export", run_dir, out]) == 0
    assert capsys.readouterr().out.startswith(f"exported step {STEPS} of {run_dir} to {out}")
    version, published = mirror_arrays(run_dir)
    exported = dict(load_model(out).named_params())
    assert version == STEPS and exported.keys() == published.keys()
    for name, array in published.items():
        np.testing.assert_array_equal(np.asarray(exported[name]), array, err_msg=name)
