"""Sequence packing: the packed layout holds every token once, the model on packed rows gives each
sequence's own log-probs with every attention kernel, and a packed train step makes the same
update as the padded one (whole batch, micro-batches, PPO's value head, through the Trainer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rlax_tasks.algorithms import make_objective
from rlax_tasks.models import attention, forward
from rlax_tasks.trainer import StepSettings, Trainer, TrainerConfig, make_train_step
from rlax_tasks.trainer.packing import (
    MIN_ROW_WIDTH,
    assign_rows,
    pack_batch,
    row_multiple,
    row_width,
)
from rlax_tasks.trainer.train_step import PACKED_KEYS, init_value_head, unpack_tokens
from tests.trainer.helpers import random_batch, tiny_policy


def _packed(batch: dict, width: int, multiple: int = 1) -> dict:
    packed = pack_batch(batch["input_ids"], batch["attention_mask"], width, multiple=multiple)
    assert packed is not None
    values = (packed.input_ids, packed.segment_ids, packed.token_index)
    return {**batch, **dict(zip(PACKED_KEYS, values, strict=True))}


def test_every_token_lands_once_in_its_own_segment() -> None:
    batch = random_batch(3, batch=32, seq_len=16)  # left-padded prompts, right-padded answers
    ids, attn = batch["input_ids"], batch["attention_mask"]
    packed = pack_batch(ids, attn, 16)
    assert packed is not None and packed.rows < 32
    r, w = packed.input_ids.shape
    assert w == 16 and packed.token_index.shape == ids.shape
    assert (packed.segment_ids > 0).sum() == attn.sum()  # every token placed, nothing more
    for b in range(32):
        cols = np.flatnonzero(attn[b])
        where = packed.token_index[b, cols[1:]]  # the first token has no log-prob: index R * T
        assert packed.token_index[b, cols[0]] == r * w
        assert (packed.token_index[b, np.flatnonzero(attn[b] == 0)] == r * w).all()
        assert (packed.input_ids.reshape(-1)[where] == ids[b, cols[1:]]).all()
        segment = packed.segment_ids.reshape(-1)[where]
        assert (segment == segment[0]).all() and segment[0] > 0
        assert (np.diff(where) == 1).all()  # contiguous, in order
    flat = packed.token_index[packed.token_index < r * w]
    assert len(np.unique(flat)) == flat.size  # no two tokens share a slot


def test_rows_are_rounded_and_packing_that_saves_nothing_is_skipped() -> None:
    ids = np.ones((64, 8), np.int32)
    attn = np.zeros((64, 8), np.int32)
    attn[:, :3] = 1  # 64 sequences of 3 tokens: 2 per row of 8 -> 32 rows
    assert pack_batch(ids, attn, 8).rows == 32
    assert pack_batch(ids, attn, 8, multiple=row_multiple(64, 8, 8, 6)).rows == 48
    assert row_multiple(64, 8, 8, 6) == 24  # 64 x 8 / 8 tokens = 8 rows of 8, and 6 | R
    assert row_width(8) == MIN_ROW_WIDTH and row_width(512) == 512
    wide = pack_batch(ids, attn)  # narrow batches pack into rows MIN_ROW_WIDTH wide
    assert wide.input_ids.shape == (-(-64 // (MIN_ROW_WIDTH // 3)), MIN_ROW_WIDTH)
    assert pack_batch(ids, np.ones_like(attn), 8) is None  # full rows: nothing to gain
    attn[:, :6] = 1  # 6 of 8 tokens: 64 rows of 8, or 13 of 32 (416 slots against 512)
    assert pack_batch(ids, attn, 8) is None and pack_batch(ids, attn).rows == 13
    with pytest.raises(ValueError, match="does not fit width 4"):
        assign_rows(np.array([3, 5]), 4)
    with pytest.raises(ValueError, match="packed rows 4 wide"):
        pack_batch(ids, attn, 4)


def test_a_row_holds_at_most_the_attention_kernels_segments() -> None:
    # 100 one-token sequences: 32 a row of 64 (cuDNN's packed layout has a static bound), not 64
    row, _, segment, n = assign_rows(np.ones(100, np.int64), 64)
    assert attention.MAX_PACKED_SEGMENTS == 32 and n == 4
    assert np.bincount(row).max() == 32 and segment.max() == 32
    _, _, segment, n = assign_rows(np.ones(100, np.int64), 64, max_segments=64)
    assert n == 2 and segment.max() == 64


def test_best_fit_decreasing_fills_the_fullest_row_first() -> None:
    row, offset, segment, n = assign_rows(np.array([5, 3, 4, 2, 2, 0]), 8)
    # 5 -> row 0 (3 free); 4 -> row 1 (4 free); 3 -> row 0 (full); 2 -> row 1; 2 -> row 1
    assert n == 2
    assert row.tolist() == [0, 0, 1, 1, 1, 0] and offset.tolist() == [0, 5, 0, 4, 6, 0]
    assert segment.tolist() == [1, 2, 1, 2, 3, 0]  # numbered along each row


@pytest.mark.parametrize("implementation", ["blocked", "xla", "splash"])
def test_packed_rows_give_each_sequence_its_own_logprobs(implementation, monkeypatch) -> None:  # noqa: ANN001
    if implementation == "splash":  # the TPU kernel in the Pallas interpreter
        splash = attention.splash_causal_attend
        monkeypatch.setattr(
            attention, "splash_causal_attend", lambda *a: splash(*a, interpret=True)
        )
    monkeypatch.setenv(attention.ATTENTION_ENV, implementation)
    policy = tiny_policy(1)
    batch = random_batch(5, batch=16, seq_len=24)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    packed = pack_batch(ids, attn)
    assert packed is not None and packed.rows < 16
    want = forward.token_logprobs(policy.graphdef, policy.params, ids, attn)
    got = forward.token_logprobs(
        policy.graphdef, policy.params, packed.input_ids, segment_ids=packed.segment_ids
    )
    got = unpack_tokens(got, jnp.asarray(packed.token_index))
    scored = packed.token_index < packed.input_ids.size  # every token after a sequence's first
    assert scored.sum() == attn.sum() - 16
    np.testing.assert_allclose(np.asarray(got)[scored], np.asarray(want)[scored], atol=2e-5)


def test_blocked_attention_over_packed_segments_equals_the_reference() -> None:
    segments = np.array([[1] * 5 + [2] * 7 + [3] * 3 + [0] * 3, [1] * 18], np.int32)
    segments = jnp.asarray(segments)
    positions = forward.positions_from_segments(segments)
    assert positions[0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1, 2]
    keys = jax.random.split(jax.random.key(0), 3)
    heads = zip(keys, (4, 2, 2), strict=True)
    q, k, v = (jax.random.normal(key, (2, 18, n, 8)) for key, n in heads)
    reference = jax.jit(attention.attend)(q, k, v, positions, positions, segments, segments)
    blocked = jax.jit(attention.blocked_causal_attend, static_argnames="block")(
        q, k, v, positions, segments, block=4
    )
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(reference), atol=1e-5)
    # segment 2's first query sees itself only: its output is its own value
    np.testing.assert_allclose(
        np.asarray(reference[0, 5]), np.asarray(jnp.repeat(v[0, 5], 2, axis=0)), atol=1e-6
    )


@pytest.mark.parametrize(
    ("algorithm", "micro", "width"),
    # (grpo over the whole batch: the Trainer test below)
    [("grpo", 4, 16), ("grpo", 8, 32), ("ppo", None, 32), ("ppo", 8, 16)],
)
def test_a_packed_train_step_makes_the_padded_update(algorithm, micro, width) -> None:  # noqa: ANN001
    policy = tiny_policy(2)
    objective = make_objective(algorithm, kl_beta=0.0)
    params = {"model": policy.params}
    if objective.needs_values:
        head = init_value_head(policy.config.hidden_size)
        params["value_head"] = {"kernel": head["kernel"] + 0.3, "bias": head["bias"] + 0.1}
    batch = random_batch(7, batch=16, seq_len=16)
    # eps well above float32 noise: Adam's first update lr * g / (|g| + eps) would turn a
    # gradient at rounding level (~1e-8, where packed and padded sums may differ) into +-lr
    optimizer = optax.adam(1e-2, eps=1e-6)
    step = jax.jit(
        make_train_step(policy.graphdef, objective, optimizer, StepSettings(micro_batch_size=micro))
    )
    n_micro = 16 // (micro or 16)
    padded = step(params, optimizer.init(params), batch)
    packed = step(params, optimizer.init(params), _packed(batch, width, n_micro))
    # atol: 0.5% of one update of lr 1e-2. An element whose gradient is near eps gets an
    # update of up to lr whose rounding differs with the summation order: on one AMD EPYC
    # (XLA's CPU code for its instruction set) one element in 4096 differed by 2.25e-5 (ppo-8-16)
    for want, got in zip(jax.tree.leaves(padded[0]), jax.tree.leaves(packed[0]), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=5e-5)
    for key in ("loss", "grad_norm", "entropy", "old_logprob_mean", "tokens"):
        np.testing.assert_allclose(float(packed[2][key]), float(padded[2][key]), rtol=1e-4)


@pytest.mark.parametrize("mesh_shape", [(1, 1, 1), (1, 4, 1)], ids=["one-device", "fsdp-4"])
def test_the_trainer_packs_and_trains_as_without(mesh_shape, tmp_path) -> None:  # noqa: ANN001
    batch = random_batch(11, batch=32, seq_len=16)
    base = dict(learning_rate=1e-2, mesh_shape=mesh_shape, seed=0)
    results = []
    for pack in (True, False):
        trainer = Trainer(
            tiny_policy(3),
            make_objective("grpo"),
            TrainerConfig(**base, pack_sequences=pack),
            str(tmp_path / str(pack)),
        )
        placed = trainer._place_batch(batch)
        assert (PACKED_KEYS[0] in placed) is pack
        metrics = trainer.step(batch)
        rows = placed[PACKED_KEYS[0]].shape if pack else batch["input_ids"].shape
        assert metrics["train_rows"] == rows[0] and (rows[0] < 32) is pack
        assert metrics["train_fill"] == pytest.approx(batch["attention_mask"].sum() / np.prod(rows))
        results.append((jax.tree.leaves(trainer.params), metrics))
        trainer.close()
    (packed, m_packed), (padded, m_padded) = results
    for got, want in zip(packed, padded, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)
    assert m_packed["tokens"] == m_padded["tokens"]
