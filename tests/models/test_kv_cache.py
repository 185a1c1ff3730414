"""Incremental decoding through the KV cache equals the full (no-cache) forward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tasks.models import Policy, forward
from rlax_tasks.models.kv_cache import init_cache
from tests.tiny_model import tiny_model_config

CONFIG = tiny_model_config(model_type="qwen3", vocab_size=89, qkv_bias=False, qk_norm=True)


@pytest.fixture(scope="module")
def policy():
    return Policy.init(CONFIG, seed=7)


def test_prefill_then_decode_matches_full_forward(policy):
    rng = np.random.default_rng(0)
    lengths, bucket, steps, max_len = [5, 11], 12, 6, 24
    seqs = [rng.integers(1, CONFIG.vocab_size, n + steps) for n in lengths]
    cache = init_cache(CONFIG, len(lengths), max_len, jnp.float32)
    step = jax.jit(forward.extend_cache, static_argnums=0)

    # prefill: prompts right-padded to one bucket; padding entries are invalid
    ids = np.zeros((2, bucket), np.int32)
    valid = np.zeros((2, bucket), bool)
    for row, n in enumerate(lengths):
        ids[row, :n] = seqs[row][:n]
        valid[row, :n] = True
    positions = np.broadcast_to(np.arange(bucket), (2, bucket)).astype(np.int32)
    start = np.zeros(2, np.int32)
    logits, cache = step(policy.graphdef, policy.params, ids, positions, valid, cache, start)
    got = {row: [np.asarray(logits[row, n - 1])] for row, n in enumerate(lengths)}

    # decode: one token per row, written right after each row's last real token
    for s in range(steps - 1):
        pos = np.array([[n + s] for n in lengths], np.int32)
        tok = np.array([[seqs[row][n + s]] for row, n in enumerate(lengths)], np.int32)
        logits, cache = step(
            policy.graphdef, policy.params, tok, pos, np.ones((2, 1), bool), cache, pos[:, 0]
        )
        for row in range(2):
            got[row].append(np.asarray(logits[row, 0]))

    for row, n in enumerate(lengths):
        full = np.asarray(policy.logits(seqs[row][None]))[0]
        np.testing.assert_allclose(np.stack(got[row]), full[n - 1 : n + steps - 1], atol=1e-5)


def test_logits_at_returns_each_rows_chosen_token_alone(policy):
    """A prefill asks for its last prompt token's logits only: [B, 1, V], the same values."""
    rng = np.random.default_rng(2)
    ids = rng.integers(1, CONFIG.vocab_size, (3, 8)).astype(np.int32)
    positions = np.broadcast_to(np.arange(8, dtype=np.int32), (3, 8))
    lengths = np.array([8, 3, 5], np.int32)
    valid = positions < lengths[:, None]
    step = jax.jit(forward.extend_cache, static_argnums=0, static_argnames="fresh")
    args = (policy.graphdef, policy.params, ids, positions, valid)
    cache, start = init_cache(CONFIG, 3, 8, jnp.float32), np.zeros(3, np.int32)
    full, full_cache = step(*args, cache, start, fresh=True)
    cache = init_cache(CONFIG, 3, 8, jnp.float32)
    last, last_cache = step(*args, cache, start, fresh=True, logits_at=lengths - 1)
    assert last.shape == (3, 1, CONFIG.vocab_size)
    np.testing.assert_allclose(last[:, 0], np.asarray(full)[np.arange(3), lengths - 1], atol=1e-6)
    np.testing.assert_array_equal(last_cache.k, full_cache.k)


def test_row_reset_by_invalidating_entries(policy):
    """A slot reused for a new prompt must not see the previous occupant's entries."""
    rng = np.random.default_rng(1)
    step = jax.jit(forward.extend_cache, static_argnums=0)
    cache = init_cache(CONFIG, 1, 16, jnp.float32)
    old = rng.integers(1, CONFIG.vocab_size, (1, 10)).astype(np.int32)
    pos = np.arange(10, dtype=np.int32)[None]
    _, cache = step(
        policy.graphdef,
        policy.params,
        old,
        pos,
        np.ones((1, 10), bool),
        cache,
        np.zeros(1, np.int32),
    )
    cache = cache._replace(valid=jnp.zeros_like(cache.valid))
    new = rng.integers(1, CONFIG.vocab_size, (1, 4)).astype(np.int32)
    logits, _ = step(
        policy.graphdef,
        policy.params,
        new,
        pos[:, :4],
        np.ones((1, 4), bool),
        cache,
        np.zeros(1, np.int32),
    )
    np.testing.assert_allclose(np.asarray(logits), np.asarray(policy.logits(new)), atol=1e-5)


def test_blocked_causal_attention_equals_full_attention():
    from rlax_tasks.models.attention import attend
    from rlax_tasks.models.attention import blocked_causal_attend as causal_self_attend
    from rlax_tasks.models.forward import positions_from_mask

    rng = np.random.default_rng(3)
    b, t, h, kv, hd = 3, 50, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, h, hd)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, kv, hd)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, kv, hd)), jnp.float32)
    valid = np.ones((b, t), bool)
    valid[1, :17] = False  # left padding
    valid[2, 40:] = False  # right padding
    pos = positions_from_mask(jnp.asarray(valid))
    full = attend(q, k, v, pos, pos, jnp.asarray(valid))
    for block in (7, 16, 50, 64):
        blocked = causal_self_attend(q, k, v, pos, jnp.asarray(valid), block=block)
        np.testing.assert_allclose(np.asarray(blocked)[valid], np.asarray(full)[valid], atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 5])
def test_attention_over_the_cache_layout_equals_the_reference(tokens):
    """Decode attends over the cache's transposed layout; it must equal ``attend`` on the
    activations' layout, for one and several new tokens per row and grouped query heads."""
    from rlax_tasks.models.attention import attend, attend_cache
    from rlax_tasks.models.kv_cache import keys_to_cache, values_to_cache

    rng = np.random.default_rng(4)
    b, s, h, kv, hd = 3, 20, 6, 2, 8
    q = jnp.asarray(rng.normal(size=(b, tokens, h, hd)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, s, kv, hd)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, s, kv, hd)), jnp.float32)
    k_pos = jnp.asarray(rng.permutation(s)[None].repeat(b, 0), jnp.int32)  # any entry order
    k_valid = jnp.asarray(rng.random((b, s)) < 0.8)
    q_pos = jnp.asarray(rng.integers(5, s, (b, tokens)), jnp.int32)
    want = attend(q, k, v, q_pos, k_pos, k_valid)
    got = attend_cache(q, keys_to_cache(k), values_to_cache(v), q_pos, k_pos, k_valid)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
