"""A tiny Qwen2 policy, deterministic random RL batches and small checkpoint states for the
trainer tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rlax_tasks.models import Policy
from tests.tiny_model import tiny_model_config

VOCAB = 64


def tiny_policy(seed: int = 0) -> Policy:
    """The tests' tiny model (vocab ``VOCAB``), random weights from ``seed``."""
    return Policy.init(tiny_model_config(vocab_size=VOCAB), seed=seed)


def random_batch(
    seed: int, batch: int = 8, seq_len: int = 16, group_size: int = 4
) -> dict[str, np.ndarray]:
    """Left-padded prompts + right-padded completions of varying lengths, random rewards."""
    rng = np.random.default_rng(seed)
    ids = np.zeros((batch, seq_len), np.int32)
    attn = np.zeros((batch, seq_len), np.int32)
    comp = np.zeros((batch, seq_len), np.int32)
    prompt_len = seq_len // 2
    for b in range(batch):
        p = int(rng.integers(2, prompt_len + 1))  # real prompt tokens, left-padded
        c = int(rng.integers(1, seq_len - prompt_len + 1))  # completion tokens, right-padded
        ids[b, prompt_len - p : prompt_len + c] = rng.integers(3, VOCAB, p + c)
        attn[b, prompt_len - p : prompt_len + c] = 1
        comp[b, prompt_len : prompt_len + c] = 1
    return {
        "input_ids": ids,
        "attention_mask": attn,
        "completion_mask": comp,
        "behavior_logprobs": (np.log(1.0 / VOCAB) + 0.1 * rng.standard_normal(ids.shape)).astype(
            np.float32
        )
        * comp,
        "rewards": rng.integers(0, 2, batch).astype(np.float32),
        "group_ids": np.repeat(np.arange(batch // group_size), group_size).astype(np.int32),
    }


def small_state(seed: int) -> dict:
    """A two-array checkpoint state whose values follow from ``seed``."""
    rng = np.random.default_rng(seed)
    return {"w": jnp.asarray(rng.standard_normal((4, 8), np.float32)), "n": jnp.asarray(seed)}


def abstract(state: dict) -> dict:
    """The shapes and dtypes of ``state`` (what a restore asks for)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
