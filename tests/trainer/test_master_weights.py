"""Precision (docs/design.md §12): bfloat16 compute keeps float32 master weights and Adam moments.

At the presets' learning rate (1e-6) an Adam update is ~1e-6 per weight, below bfloat16's spacing
around a 0.02 weight (~8e-5): bfloat16 master weights would drop almost every update.
"""

from __future__ import annotations

import numpy as np
import pytest

from rlax_tasks.algorithms import make_objective
from rlax_tasks.models import Policy
from rlax_tasks.trainer.config import TrainerConfig
from rlax_tasks.trainer.trainer import Trainer
from tests.trainer.helpers import random_batch

jax = pytest.importorskip("jax")

# over 20 steps at lr 1e-3 on the same batches: per step, |loss(bfloat16 compute) - loss(float32)|
# at most this fraction of the float32 run's largest |loss|
LOSS_TOLERANCE = 0.05
# what training did to a held-out batch's log-probs (trained - initial, float32 evaluation):
# the bfloat16-compute run's change differs from the float32 run's by at most this fraction
LOGPROB_TOLERANCE = 0.1


def _train(model, dtype: str, param_dtype: str, lr: float, steps: int, tmp_path) -> tuple:  # noqa: ANN001
    policy = Policy.init(model, dtype=dtype, param_dtype=param_dtype, seed=0)
    initial = [np.asarray(x, np.float32) for x in jax.tree.leaves(policy.params)]
    # (unpacked: packed row counts vary with the random batches, each count a compile)
    config = TrainerConfig(
        learning_rate=lr, mesh_shape=(1, 1, 1), async_checkpointing=False, pack_sequences=False
    )
    run_dir = tmp_path / f"{dtype}-{param_dtype}-{lr}"
    with Trainer(policy, make_objective("grpo"), config, str(run_dir)) as trainer:
        losses = [trainer.step(random_batch(s, batch=16, seq_len=32))["loss"] for s in range(steps)]
        params = trainer.params
        final = [np.asarray(x, np.float32) for x in jax.tree.leaves(params)]
        param_dtypes = {str(x.dtype) for x in jax.tree.leaves(params)}
        moment_dtypes = {
            str(x.dtype)
            for x in jax.tree.leaves(trainer.opt_state)
            if getattr(x, "ndim", 0) > 0  # the moments (the step count is a scalar)
        }
        trained = trainer.policy().as_dtype("float32")
        held_out = random_batch(99, batch=8, seq_len=32)
        logprobs = np.asarray(
            trained.token_logprobs(held_out["input_ids"], held_out["attention_mask"])
        )
    changed = sum(int((a != b).sum()) for a, b in zip(initial, final, strict=True))
    fraction = changed / sum(a.size for a in initial)
    return (
        fraction,
        np.asarray(losses),
        param_dtypes,
        moment_dtypes,
        logprobs * held_out["completion_mask"],
    )


def test_bfloat16_compute_keeps_float32_master_weights_and_moments(tiny_config, tmp_path) -> None:  # noqa: ANN001
    f32, _, f32_dtypes, _ = _train(tiny_config, "float32", "float32", 1e-6, 3, tmp_path)[:4]
    mixed, _, mixed_dtypes, mixed_moments = _train(
        tiny_config, "bfloat16", "float32", 1e-6, 3, tmp_path
    )[:4]
    assert f32 >= 0.95, f32
    assert mixed >= 0.95, f"bfloat16 compute changed only {mixed:.1%} of the float32 weights"
    assert mixed_dtypes == {"float32"} and mixed_moments == {"float32"}, (
        mixed_dtypes,
        mixed_moments,
    )
    # what the presets did before (parameters in the compute dtype): the updates are lost
    low, _, low_dtypes, _ = _train(tiny_config, "bfloat16", "bfloat16", 1e-6, 3, tmp_path)[:4]
    assert low_dtypes == {"bfloat16"}
    assert low < 0.2, low


def test_bfloat16_compute_trains_like_float32(tiny_config, tmp_path) -> None:  # noqa: ANN001
    _, loss32, _, _, lp32 = _train(tiny_config, "float32", "float32", 1e-3, 20, tmp_path)
    _, loss16, _, _, lp16 = _train(tiny_config, "bfloat16", "float32", 1e-3, 20, tmp_path)
    assert np.abs(loss16 - loss32).max() <= LOSS_TOLERANCE * np.abs(loss32).max(), (loss32, loss16)
    held_out = random_batch(99, batch=8, seq_len=32)
    initial = Policy.init(tiny_config, seed=0).token_logprobs(
        held_out["input_ids"], held_out["attention_mask"]
    )
    initial = np.asarray(initial) * held_out["completion_mask"]
    moved32, moved16 = lp32 - initial, lp16 - initial
    assert np.abs(moved32).mean() > 1e-3  # training moved the policy: the comparison has teeth
    gap = np.linalg.norm(moved16 - moved32) / np.linalg.norm(moved32)
    assert gap <= LOGPROB_TOLERANCE, gap
