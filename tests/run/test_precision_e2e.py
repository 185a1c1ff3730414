"""docs/design.md §12 end to end: `rlax run` with bfloat16 compute trains float32 master weights
(checked on `rlax export` output), and the parameter server carries what workers hold (bfloat16)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from rlax_tasks.evaluation.checkpoints import mirror_arrays
from rlax_tasks.run.local_run import run_local
from rlax_tasks.tools.export import export_checkpoint
from tests.conftest import TEST_XLA_FLAGS
from tests.run.test_local_run import small_config
from tests.tiny_model import save_char_model


def _tensors(path) -> dict[str, np.ndarray]:  # noqa: ANN001
    return {k: v.astype(np.float32) for k, v in load_file(str(path / "model.safetensors")).items()}


def _bf16(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to bfloat16 (to nearest even), as float32."""
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def _base_model(path: str) -> None:
    """The tiny-arith shape class (char tokenizer; the embedding rows of characters arithmetic
    never uses get no gradient, ~3% of this model, as of the preset's)."""
    save_char_model(path, "wide")


@pytest.mark.slow
def test_bfloat16_run_at_lr_1e6_changes_the_float32_master_weights(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("XLA_FLAGS", TEST_XLA_FLAGS)  # the components need one device each
    cfg = small_config(
        tmp_path,
        **{
            "model.dtype": "bfloat16",
            "trainer.learning_rate": 1e-6,
            "trainer.warmup_steps": 0,  # 1e-6 from the first step
            "trainer.checkpoint_every": 3,
        },
    )
    _base_model(cfg.model.path)  # replaces small_config's smaller model
    run_local(cfg, steps=3, evaluate=False)

    out = tmp_path / "exported"
    result = export_checkpoint(cfg.run_dir, str(out))
    assert result.step == 3 and result.dtype == "float32"
    base, trained = _tensors(tmp_path / "model"), _tensors(out)
    delta = np.concatenate([(trained[k] - base[k]).ravel() for k in base])
    # the control: rounding to bfloat16 alone moves nearly every weight, by far more than 1e-6
    rounded = np.concatenate([(_bf16(base[k]) - base[k]).ravel() for k in base])
    assert np.mean(rounded != 0) >= 0.95 and np.median(np.abs(rounded)) > 1e-5
    # trained: nearly every weight moved, by three Adam steps of at most ~lr = 1e-6 each (weights
    # held in bfloat16, or rounded through it, would move by the control's amounts; lr 0: none)
    moved = np.abs(delta[delta != 0])
    assert moved.size / delta.size >= 0.95, f"only {moved.size / delta.size:.1%} changed"
    assert 3e-7 < np.median(moved) < 4e-6, np.median(moved)
    assert moved.max() < 1e-5, moved.max()

    version, arrays = mirror_arrays(cfg.run_dir)  # what the parameter server carried
    assert version >= 1
    assert {str(a.dtype) for a in arrays.values()} == {"bfloat16"}
