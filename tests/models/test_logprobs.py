"""Chunked per-token log-probabilities equal the naive full-logits log-softmax gather."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rlax_tasks.models import LogProbOptions, Policy, forward
from tests.models.hf_models import left_padded_batch
from tests.tiny_model import tiny_model_config

CONFIG = tiny_model_config(vocab_size=211)


@pytest.fixture(scope="module")
def policy():
    return Policy.init(CONFIG, seed=3)


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 64, 1000])
def test_chunked_equals_naive(policy, chunk_size):
    ids, mask = left_padded_batch(np.random.default_rng(0), CONFIG.vocab_size, [33, 20, 5])
    chunked = np.asarray(policy.token_logprobs(ids, mask, LogProbOptions(chunk_size)))
    naive = np.asarray(forward.naive_token_logprobs(policy.logits(ids, mask), ids))
    assert chunked.shape == ids.shape
    assert np.all(chunked[:, 0] == 0)
    np.testing.assert_allclose(chunked, naive, atol=1e-5, rtol=0)


def test_gradients_through_chunks_equal_naive(policy):
    ids, mask = left_padded_batch(np.random.default_rng(1), CONFIG.vocab_size, [17, 9])
    weights = jnp.asarray(np.random.default_rng(2).normal(size=ids.shape), jnp.float32)

    def chunked_loss(params):
        lp = forward.token_logprobs(policy.graphdef, params, ids, mask, LogProbOptions(4))
        return jnp.sum(lp * weights * mask)

    def naive_loss(params):
        lg = forward.logits(policy.graphdef, params, ids, mask)
        return jnp.sum(forward.naive_token_logprobs(lg, ids) * weights * mask)

    g1 = jax.grad(chunked_loss)(policy.params)
    g2 = jax.grad(naive_loss)(policy.params)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("keep_logits_bytes", [0, 1 << 20], ids=["recomputed", "kept"])
def test_gradients_of_logprobs_and_entropy_equal_autodiff_of_the_full_softmax(keep_logits_bytes):
    """The chunks' hand-written backward: cotangents on both outputs (an entropy bonus would
    differentiate the entropy), padding positions included, in the inputs' dtypes; with the
    logits recomputed in the backward or kept from the forward."""
    rng = np.random.default_rng(4)
    b, t, d, v = 3, 11, 8, 37
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    unembedding = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)
    g_lp, g_ent = (jnp.asarray(rng.normal(size=(b, t)), jnp.float32) for _ in range(2))

    def naive(h, u):
        logp = jax.nn.log_softmax(jnp.einsum("btd,dv->btv", h, u), axis=-1)
        lp = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return lp, -jnp.sum(jnp.exp(logp) * logp, axis=-1)

    def chunked(h, u):  # 3 chunks of 4, 1 padded
        return forward.chunked_logprobs(
            h, u, targets, LogProbOptions(4, keep_logits_bytes=keep_logits_bytes)
        )

    want_out, want_back = jax.vjp(naive, hidden, unembedding)
    got_out, got_back = jax.vjp(chunked, hidden, unembedding)
    got = got_out + got_back((g_lp, g_ent))
    want = want_out + want_back((g_lp, g_ent))
    for a, b_ in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b_, atol=2e-5, rtol=2e-5)

    # one output used alone: the other's cotangent is a symbolic zero, whose term is skipped
    def one_output(fn, i, g):  # noqa: ANN001, ANN202
        return jax.grad(lambda h, u: jnp.sum(fn(h, u)[i] * g), argnums=(0, 1))(hidden, unembedding)

    for i, g in ((0, g_lp), (1, g_ent)):
        got, want = one_output(chunked, i, g), one_output(naive, i, g)
        for a, b_ in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b_, atol=2e-5, rtol=2e-5, err_msg=f"output {i}")
    g_h, g_u = jax.grad(lambda h, u: jnp.sum(chunked(h, u)[0]), argnums=(0, 1))(
        hidden.astype(jnp.bfloat16), unembedding.astype(jnp.bfloat16)
    )
    assert g_h.dtype == g_u.dtype == jnp.bfloat16


def test_logits_that_fit_the_budget_are_not_recomputed_by_the_backward():
    """Kept logits: the forward's vocabulary product and the unembedding's gradient, no third
    [., V] product; over the budget the backward recomputes the logits."""
    rng = np.random.default_rng(5)
    b, t, d, v = 2, 12, 8, 37
    hidden = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    unembedding = jnp.asarray(rng.normal(size=(d, v)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, v, (b, t)), jnp.int32)

    def vocabulary_products(budget: int) -> int:
        def loss(h, u):
            lp, _ = forward.chunked_logprobs(
                h, u, targets, LogProbOptions(4, keep_logits_bytes=budget)
            )
            return jnp.sum(lp)

        text = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, unembedding).as_text()
        results = [line.split("->")[-1] for line in text.splitlines() if "dot_general" in line]
        return sum(f"x{v}xf32>" in result for result in results)

    logits_bytes = b * t * v * 4
    assert vocabulary_products(logits_bytes) == 2
    assert vocabulary_products(logits_bytes - 1) == vocabulary_products(0) == 3


def test_the_backward_never_materializes_full_logits(policy):
    b, t, chunk = 2, 64, 8
    ids = np.zeros((b, t), np.int32)

    def loss(p, x):
        return jnp.sum(forward.token_logprobs(policy.graphdef, p, x, None, LogProbOptions(chunk)))

    hlo = jax.jit(jax.grad(loss)).lower(policy.params, ids).compile().as_text()
    assert f"f32[{b},{t - 1},{CONFIG.vocab_size}]" not in hlo
    assert f"f32[{b},{t},{CONFIG.vocab_size}]" not in hlo
    assert f"{chunk},{CONFIG.vocab_size}]" in hlo


def test_entropy_matches_full_softmax(policy):
    ids, mask = left_padded_batch(np.random.default_rng(3), CONFIG.vocab_size, [12, 12])
    lp, ent = forward.token_logprobs(
        policy.graphdef, policy.params, ids, mask, LogProbOptions(5), with_entropy=True
    )
    logp = jax.nn.log_softmax(policy.logits(ids, mask)[:, :-1], axis=-1)
    expected = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    np.testing.assert_allclose(ent[:, 1:], expected, atol=1e-5)


def test_chunked_logprobs_never_materialize_full_logits(policy):
    """The compiled program's largest f32 buffer is one chunk of logits, not [B, T, V]."""
    b, t, chunk = 2, 64, 8
    ids = np.zeros((b, t), np.int32)
    fn = jax.jit(
        lambda p, x: forward.token_logprobs(policy.graphdef, p, x, None, LogProbOptions(chunk))
    )
    hlo = fn.lower(policy.params, ids).compile().as_text()
    full = f"f32[{b},{t - 1},{CONFIG.vocab_size}]"
    assert full not in hlo and f"f32[{b},{t},{CONFIG.vocab_size}]" not in hlo
    assert f"{chunk},{CONFIG.vocab_size}]" in hlo


def test_chunks_are_equal_and_pad_as_little_as_possible(policy):
    """159 positions by chunks of at most 128 run as 2 x 80: a third chunk-length of padding
    (2 x 128) would cost as much vocabulary projection as real positions."""
    b, t = 2, 160
    ids = np.zeros((b, t), np.int32)
    fn = jax.jit(
        lambda p, x: forward.token_logprobs(policy.graphdef, p, x, None, LogProbOptions(128))
    )
    hlo = fn.lower(policy.params, ids).compile().as_text()
    assert f"f32[{b},80,{CONFIG.vocab_size}]" in hlo
    assert f"f32[{b},128,{CONFIG.vocab_size}]" not in hlo


def test_out_of_range_token_ids_are_rejected(policy):
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 211\)"):
        policy.logits(np.array([[1, 2, 211]]))


@pytest.mark.parametrize("extra", [0, 1])
def test_stacks_up_to_the_unroll_limit_run_their_layers_unrolled(extra):
    """The full-sequence pass (the train step's) runs a stack of at most UNROLL_LAYERS_UP_TO
    layers unrolled, without a layer loop whose stacked residuals are zero-filled and sliced;
    deeper stacks keep the scan (compile time flat in depth)."""
    from flax import nnx

    from rlax_tasks.models.transformer import UNROLL_LAYERS_UP_TO

    config = tiny_model_config(num_hidden_layers=UNROLL_LAYERS_UP_TO + extra)
    policy = Policy.init(config, seed=0)
    ids, mask = left_padded_batch(np.random.default_rng(0), config.vocab_size, [9, 5])

    def loss(params):
        inputs = forward.model_inputs(ids, mask)
        return jnp.sum(nnx.merge(policy.graphdef, params).hidden_states_and_routes(*inputs)[0])

    text = jax.jit(jax.grad(loss)).lower(policy.params).as_text()
    assert ("stablehlo.while" in text) == bool(extra)


def _support_case(seed: int = 6) -> tuple:
    """hidden, unembedding, targets and a support [B, T, R] holding each target (R up to 5 ids,
    -1 padded; every third position without entries: the whole vocabulary)."""
    rng = np.random.default_rng(seed)
    b, t, d, v, r = 3, 10, 8, 37, 5
    targets = rng.integers(0, v, (b, t))
    support = np.full((b, t, r), -1)
    for i in range(b):
        for j in range(t):
            if (i + j) % 3:
                ids = rng.choice(v, int(rng.integers(1, r + 1)), replace=False)
                if targets[i, j] not in ids:
                    ids[rng.integers(len(ids))] = targets[i, j]
                support[i, j, : len(ids)] = ids
    hidden = rng.normal(size=(b, t, d)).astype(np.float32)
    unembedding = rng.normal(size=(d, v)).astype(np.float32)
    return hidden, unembedding, targets, support


def _numpy_support_logprobs(hidden, unembedding, targets, support, temperature=1.0):
    """float64 NumPy: log p over each position's support (its kept ids; all ids without any)
    and the entropy of that renormalised distribution, written from the definition."""
    logits = np.einsum("btd,dv->btv", hidden.astype(np.float64), unembedding) / temperature
    b, t, v = logits.shape
    lp, ent = np.zeros((b, t)), np.zeros((b, t))
    for i in range(b):
        for j in range(t):
            kept = [int(x) for x in support[i, j] if x >= 0] or list(range(v))
            z = logits[i, j, kept]
            log_norm = np.log(np.sum(np.exp(z - z.max()))) + z.max()
            lp[i, j] = logits[i, j, targets[i, j]] - log_norm
            p = np.exp(z - log_norm)
            ent[i, j] = -np.sum(p * (z - log_norm))
    return lp, ent


@pytest.mark.parametrize("keep_logits_bytes", [0, 1 << 20], ids=["recomputed", "kept"])
def test_logprobs_over_a_replayed_sampling_support_match_numpy(keep_logits_bytes):
    """Sampling-mask replay: the log-probs (hence the trainer's ratio) and entropy renormalised
    over the ids the sampler's top-k/top-p kept, against NumPy; their gradients against
    autodiff of the masked full softmax; with the temperature applied too."""
    hidden, unembedding, targets, support = _support_case()
    want_lp, want_ent = _numpy_support_logprobs(hidden, unembedding, targets, support, 0.7)
    args = jnp.asarray(hidden), jnp.asarray(unembedding)
    tg, sup = jnp.asarray(targets, jnp.int32), jnp.asarray(support, jnp.int32)

    def chunked(h, u):  # chunks of 4: 3 chunks, 2 padded positions
        return forward.chunked_logprobs(
            h,
            u,
            tg,
            LogProbOptions(4, keep_logits_bytes=keep_logits_bytes, temperature=0.7),
            support=sup,
        )

    lp, ent = chunked(*args)
    np.testing.assert_allclose(lp, want_lp, atol=2e-5)
    np.testing.assert_allclose(ent, want_ent, atol=2e-5)
    full_lp, _ = forward.chunked_logprobs(*args, tg, LogProbOptions(4, temperature=0.7))
    restricted = np.any(support >= 0, axis=-1)
    assert np.all(np.asarray(lp)[restricted] > np.asarray(full_lp)[restricted])  # renormalised
    np.testing.assert_array_equal(lp[~restricted], full_lp[~restricted])

    member = np.zeros(hidden.shape[:2] + (unembedding.shape[1],), bool)
    for (i, j, _), x in np.ndenumerate(support):
        member[i, j, x] |= x >= 0
    member |= ~restricted[..., None]

    def naive(h, u):
        lg = jnp.where(member, jnp.einsum("btd,dv->btv", h, u) / 0.7, -1e9)  # finite: no NaN
        logp = jax.nn.log_softmax(lg, axis=-1)
        picked = jnp.take_along_axis(logp, tg[..., None], axis=-1)[..., 0]
        return picked, -jnp.sum(jnp.where(member, jnp.exp(logp) * logp, 0.0), axis=-1)

    rng = np.random.default_rng(7)
    cot = tuple(jnp.asarray(rng.normal(size=targets.shape), jnp.float32) for _ in range(2))
    got = jax.vjp(chunked, *args)[1](cot)
    want = jax.vjp(naive, *args)[1](cot)
    for a, b_ in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b_, atol=5e-5, rtol=5e-5)
