"""Exact and MinHash near-duplicate detection."""

import random

import numpy as np
import pytest

from rlax_tasks.curation.dedup import (
    MinHashConfig,
    exact_duplicates,
    minhash_signatures,
    near_duplicates,
)

WORDS = (
    "find the value of each integer such that a triangle circle area sum product prime "
    "divisor probability expected number sequence real roots polynomial equation"
).split()


def random_text(rng, n_words=30):
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def shingles(text, k=5):
    return {text[i : i + k] for i in range(max(len(text) - k + 1, 1))}


def jaccard(a, b):
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / len(sa | sb)


def test_exact_duplicates_point_at_the_first_occurrence():
    first = exact_duplicates(["a", "b", "a", "c", "b", "a"])
    assert first.tolist() == [0, 1, 0, 3, 1, 0]


def test_signature_agreement_estimates_jaccard():
    rng = random.Random(0)
    config = MinHashConfig(bands=32, rows_per_band=8)
    pairs = []
    for _ in range(40):
        a = random_text(rng)
        words = a.split()
        for _ in range(rng.randint(0, 8)):
            words[rng.randrange(len(words))] = rng.choice(WORDS)
        pairs.append((a, " ".join(words)))
    texts = [t for p in pairs for t in p]
    sig = minhash_signatures(texts, config)
    est = (sig[0::2] == sig[1::2]).mean(axis=1)
    true = np.array([jaccard(a, b) for a, b in pairs])
    assert np.abs(est - true).mean() < 0.04
    assert np.abs(est - true).max() < 0.15


def test_signatures_do_not_depend_on_chunking():
    rng = random.Random(1)
    texts = [random_text(rng, rng.randint(1, 40)) for _ in range(50)] + ["ab", "x"]
    a = minhash_signatures(texts, MinHashConfig(chunk_rows=7))
    b = minhash_signatures(texts, MinHashConfig(chunk_rows=1000))
    np.testing.assert_array_equal(a, b)
    # a short text is its own single shingle: equal texts, equal signatures
    c = minhash_signatures(["ab", "ab", "ba"], MinHashConfig())
    assert (c[0] == c[1]).all() and not (c[0] == c[2]).all()


def test_near_duplicates_keep_the_first_and_report_similarity():
    rng = random.Random(2)
    base = [random_text(rng, 40) for _ in range(200)]
    texts = list(base)
    for i in range(0, 200, 10):  # 20 near copies: one word changed
        words = base[i].split()
        words[5] = "zebra"
        texts.append(" ".join(words))
    rep, sim = near_duplicates(texts, MinHashConfig(threshold=0.7))
    copies = np.arange(200, 220)
    assert rep[copies].tolist() == list(range(0, 200, 10))
    assert (rep[:200] == np.arange(200)).all()  # distinct random texts stay
    assert (sim[copies] >= 0.7).all() and (sim[:200] == 1.0).all()


def test_numbers_guard_keeps_problems_that_differ_only_in_numbers():
    template = "Compute {} + {}. Put the final answer in a box and explain every step carefully."
    texts = [template.format(123, 456), template.format(123, 457), template.format(123, 456)]
    rep, _ = near_duplicates(texts, MinHashConfig(threshold=0.7))
    assert rep.tolist() == [0, 1, 0]
    rep, _ = near_duplicates(texts, MinHashConfig(threshold=0.7, same_numbers=False))
    assert rep.tolist() == [0, 0, 0]


def test_minhash_config_validation():
    with pytest.raises(ValueError, match="threshold"):
        MinHashConfig(threshold=0.0)
    with pytest.raises(ValueError, match="bands"):
        MinHashConfig(bands=0)
