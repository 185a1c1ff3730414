"""The sampler's token choice: greedy picks as argmax does, draws invert the exact CDF."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from rlax_tasks.rollout.sampling import (
    filter_logits,
    greedy_tokens,
    inverse_cdf_draw,
    sample_tokens,
)


def test_greedy_tokens_are_argmax_with_the_first_of_ties():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 1000)).astype(np.float32)
    logits[1, [7, 500, 999]] = 50.0  # ties: the first wins
    logits[2, :] = -np.inf
    logits[2, 998] = 0.0  # one finite entry among -inf
    logits[3, :] = 1.0  # all equal: token 0
    logits[4, 130:140] = 9.0  # a tie inside one block, not its first entry
    got = np.asarray(jax.jit(greedy_tokens)(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert got.dtype == np.int32
    nan = np.full((1, 1000), np.nan, np.float32)
    assert int(jax.jit(greedy_tokens)(jnp.asarray(nan))[0]) == 999  # no maximum: the last token


def test_sampled_and_greedy_log_probs_are_the_log_softmax_of_their_distribution():
    """Greedy rows: log softmax(logits) at the argmax; sampled rows: log softmax(logits / T) at
    the drawn token (float64 reference), in one batch mixing both."""
    rng = np.random.default_rng(1)
    logits = (3 * rng.standard_normal((8, 3001))).astype(np.float32)
    temperature = np.array([0, 0.7, 1.0, 0, 1.3, 0.5, 0, 2.0], np.float32)
    keys = _row_keys(4, 8)
    off_k, off_p = jnp.zeros(8, jnp.int32), jnp.ones(8, jnp.float32)
    for sampling in (True, False):
        t = temperature if sampling else np.zeros_like(temperature)
        tokens, lp, _ = jax.jit(sample_tokens, static_argnums=(5, 6))(
            jnp.asarray(logits), keys, jnp.asarray(t), off_k, off_p, False, sampling
        )
        tokens, lp = np.asarray(tokens), np.asarray(lp)
        scaled = logits.astype(np.float64) / np.where(t > 0, t, 1.0)[:, None]
        ref = scaled - scaled.max(-1, keepdims=True)
        ref = ref - np.log(np.exp(ref).sum(-1, keepdims=True))
        np.testing.assert_allclose(lp, ref[np.arange(8), tokens], rtol=1e-5, atol=1e-5)
        greedy = t <= 0
        np.testing.assert_array_equal(tokens[greedy], np.argmax(logits[greedy], -1))


def _row_keys(seed: int, rows: int) -> jax.Array:
    """fold_in(PRNGKey(seed), row) for each row: one key per draw."""
    return jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(seed), i))(jnp.arange(rows))


def _reference_draws(keys: jax.Array, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The single-level inversion in float64 with the same uniforms: (tokens, |u - nearest CDF
    boundary|) per row."""
    u = np.asarray(jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys), np.float64)
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    probs = np.exp(shifted)
    cdf = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)
    tokens = np.array([np.searchsorted(c, x, side="right") for c, x in zip(cdf, u, strict=True)])
    margin = np.min(np.abs(cdf - u[:, None]), axis=-1)
    return tokens, margin


def test_two_level_draw_inverts_the_same_cdf_as_one_cumulative_sum():
    """Vocabularies that are and are not a multiple of the block, with filtered (-inf) tokens:
    every draw is the token whose CDF interval holds the uniform (up to float32 rounding at a
    boundary), and never a filtered one."""
    rng = np.random.default_rng(1)
    for vocab, block in ((1000, 256), (1024, 256), (300, 64), (50, 256)):
        logits = (2 * rng.standard_normal((64, vocab))).astype(np.float32)
        logits[::3, : vocab // 2] = -np.inf  # whole blocks without mass
        logits[1::3, 1::2] = -np.inf  # holes inside blocks
        keys = _row_keys(5, 64)
        got = np.asarray(jax.jit(inverse_cdf_draw, static_argnums=2)(keys, logits, block))
        want, margin = _reference_draws(keys, logits)
        assert np.isfinite(logits[np.arange(64), got]).all()
        agree = (got == want) | (margin < 1e-5)
        assert agree.all(), (vocab, block, got[~agree], want[~agree])
        assert (got == want).mean() > 0.95


def test_draw_frequencies_follow_the_distribution():
    """20,000 draws from one 600-token distribution (three blocks, the last one padded)."""
    rng = np.random.default_rng(2)
    logits = rng.standard_normal(600).astype(np.float32)
    logits[rng.choice(600, 100, replace=False)] = -np.inf
    n = 20_000
    keys = _row_keys(9, n)
    draws = np.asarray(
        jax.jit(inverse_cdf_draw)(keys, jnp.broadcast_to(jnp.asarray(logits), (n, 600)))
    )
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    counts = np.bincount(draws, minlength=600)
    assert counts[~np.isfinite(logits)].sum() == 0
    # per-token counts within 5 standard deviations of their binomial expectation
    expected, sd = n * probs, np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - expected) <= 5 * sd + 1)


def _sorted_filter(
    logits: np.ndarray, top_k: np.ndarray, top_p: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The definition by sorting (float64): keep the top-k and the nucleus, the tokens whose
    strictly larger tokens hold less than top_p of the mass (ties at a threshold all kept).
    Also each row's margin: how close a token's mass before it comes to top_p."""
    out = np.full_like(logits, -np.inf)
    margin = np.zeros(len(logits))
    for r, row in enumerate(logits.astype(np.float64)):
        ordered = np.sort(row)[::-1]
        k = top_k[r] if 0 < top_k[r] < len(row) else len(row)
        probs = np.exp(ordered - ordered[0])
        probs /= probs.sum()
        before = np.cumsum(probs) - probs
        inside = (before < top_p[r]) | (np.arange(len(row)) == 0) | (top_p[r] >= 1.0)
        threshold = max(ordered[k - 1], ordered[inside].min())
        out[r] = np.where(row >= threshold, logits[r], -np.inf)
        margin[r] = np.abs(before - top_p[r]).min()
    return out, margin


def test_filter_keeps_the_top_k_and_the_nucleus_as_sorting_does():
    rng = np.random.default_rng(3)
    rows, vocab = 48, 3000
    logits = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    logits[0] = 0.0  # all tied, zeros of both signs
    logits[0, ::2] = -0.0
    logits[1, :10] = 20.0  # a tied top ten
    logits[2, vocab // 2 :] = -np.inf
    logits[3] -= 1e4  # far from zero, negative
    top_k = rng.choice([0, 1, 5, 50, vocab, vocab + 7], rows)
    top_p = rng.choice([1.0, 0.5, 0.9, 0.999, 1e-6], rows).astype(np.float32)
    top_k[:4], top_p[:4] = [3, 4, 0, 2], [1.0, 0.2, 0.95, 1.0]
    got = np.asarray(jax.jit(filter_logits)(logits, top_k, top_p))
    want, margin = _sorted_filter(logits, top_k, top_p)
    same = (np.isfinite(got) == np.isfinite(want)).all(-1)
    # float32 sums may put a nucleus edge one token off only where the mass is that close
    assert (same | (margin < 1e-5)).all(), np.flatnonzero(~same)
    assert same.mean() > 0.9
    np.testing.assert_array_equal(got[np.isfinite(got)], logits[np.isfinite(got)])
    assert np.isfinite(got).sum(-1)[1] == 10 and np.isfinite(got).sum(-1)[0] == vocab
