"""pass@k against exact combinatorics; maj@k on hand-made cases."""

import math
from fractions import Fraction

import pytest

from rlax_tasks.evaluation import maj_at_k, majority_answer, mean_pass_at_k, pass_at_k


def exact_pass_at_k(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def test_pass_at_k_matches_exact_combinatorics_on_small_n():
    for n in range(1, 16):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(
                    float(exact_pass_at_k(n, c, k)), rel=1e-12, abs=1e-15
                ), (n, c, k)


@pytest.mark.parametrize(
    "n,c,k",
    [
        (1000, 1, 1),
        (1000, 3, 100),
        (1000, 999, 500),
        (10_000, 7, 10),
        (100_000, 50, 1000),
        (200_000, 1, 1),
        (100_000, 2, 99_999),
        (5000, 4990, 11),
    ],
)
def test_pass_at_k_is_accurate_for_large_n(n, c, k):
    exact = exact_pass_at_k(n, c, k)
    got = pass_at_k(n, c, k)
    assert got == pytest.approx(float(exact), rel=1e-10)
    # tiny probabilities keep their relative precision (no 1 - (1 - tiny) cancellation)
    if exact < Fraction(1, 10**6):
        assert got > 0


def test_pass_at_k_edge_cases():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 6, 5) == 1.0  # every 5-subset holds a correct sample
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(200_000, 1, 1) == pytest.approx(5e-6, rel=1e-12)
    for bad in [(0, 0, 1), (5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6), (5.0, 2, 1), (5, True, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_mean_pass_at_k():
    assert mean_pass_at_k(4, [0, 4, 2], 1) == pytest.approx((0 + 1 + 0.5) / 3)
    with pytest.raises(ValueError):
        mean_pass_at_k(4, [], 1)


def test_majority_answer_and_maj_at_k_hand_made():
    answers = ["7", "5", "5", "7", None, "7"]
    rewards = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
    assert majority_answer(answers) == 0  # 7 three times
    assert maj_at_k(answers, rewards, 1) == 1.0  # only "7"
    assert maj_at_k(answers, rewards, 3) == 0.0  # "5" twice beats "7" once
    assert maj_at_k(answers, rewards, 4) == 1.0  # tie 2-2: "7" was seen first
    assert maj_at_k(answers, rewards, 6) == 1.0
    # no answers at all: no vote, score 0; None never wins a vote
    assert maj_at_k([None, None], [0.0, 0.0], 2) == 0.0
    assert maj_at_k([None, None, "3"], [0.0, 0.0, 1.0], 3) == 1.0
    # a wrong majority beats a correct minority
    assert maj_at_k(["1", "2", "2"], [1.0, 0.0, 0.0], 3) == 0.0
    with pytest.raises(ValueError):
        maj_at_k(["1"], [1.0, 0.0], 1)
    with pytest.raises(ValueError):
        maj_at_k(["1"], [1.0], 2)
