"""Math verifier: equivalence via math-verify, extraction, hard timeouts, batch and cache."""

from __future__ import annotations

import threading

import pytest

from rlax_tasks.rewards.math import VERIFIER_VERSION, MathResult, MathVerifier, verify

EQUIVALENT = [
    (r"The answer is \boxed{0.5}", r"\frac{1}{2}"),  # decimal vs fraction
    (r"\boxed{\frac12}", "1/2"),
    (r"so \boxed{\dfrac{3}{4}}", "0.75"),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),  # surds
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
    (r"\boxed{(1,3]}", "(1,3]"),  # intervals
    (r"\boxed{\{3, 1, 2\}}", r"\{1,2,3\}"),  # sets, any order
    (r"\boxed{10\text{ cm}}", "10"),  # units
    (r"\boxed{10 \mathrm{cm}}", "10"),
    (r"\boxed{x = 3}", "3"),  # x = 3 vs 3
    ("Therefore x = 3. The answer is 3.", "x = 3"),
    (r"\boxed{x^2+2x+1}", "(x+1)^2"),  # symbolic
    (r"\boxed{\text{yes}}", "yes"),
]

NOT_EQUIVALENT = [
    (r"\boxed{0.33}", r"\frac{1}{3}"),
    (r"\boxed{\sqrt{2}}", "2"),
    (r"\boxed{[1,3]}", "(1,3]"),  # closed vs half-open
    (r"\boxed{\{1,2\}}", r"\{1,2,3\}"),
    (r"\boxed{x = 4}", "3"),
    (r"\boxed{\frac{2}{3}}", "0.5"),
    (r"\boxed{x^2+1}", "(x+1)^2"),
]


@pytest.mark.parametrize(("response", "reference"), EQUIVALENT)
def test_equivalent_answers_score_one(math_verifier, response, reference):
    result = math_verifier.check(response, reference)
    assert (result.verdict, result.reward) == ("correct", 1.0), result


@pytest.mark.parametrize(("response", "reference"), NOT_EQUIVALENT)
def test_non_equivalent_answers_score_zero(math_verifier, response, reference):
    result = math_verifier.check(response, reference)
    assert (result.verdict, result.reward) == ("incorrect", 0.0), result


def test_answer_extraction(math_verifier):
    last = math_verifier.check(r"first \boxed{2}, corrected: \boxed{3}", "3")
    assert last.extracted == "3" and last.reward == 1.0
    assert math_verifier.check(r"first \boxed{3}, corrected: \boxed{2}", "3").reward == 0.0
    said = math_verifier.check("After some algebra, the final answer is 42.", "42")
    assert said.reward == 1.0
    plain = math_verifier.check("We get 7 and then, adding 5, we get 12", "12")
    assert plain.reward == 1.0
    nested = math_verifier.check(r"\boxed{\frac{1}{\sqrt{4}}}", "0.5")
    assert nested.reward == 1.0
    none = math_verifier.check("I do not know.", "3")
    assert (none.verdict, none.reward, none.extracted) == ("no_answer", 0.0, None)


def test_verify_contract_returns_float():
    assert verify(r"so the result is \boxed{\frac{6}{4}}", "1.5") == 1.0
    out = verify(r"\boxed{7}", "8")
    assert isinstance(out, float) and out == 0.0
    with pytest.raises(TypeError, match="response"):
        verify(None, "1")  # type: ignore[arg-type]


def test_batch_keeps_order_and_uses_the_cache(math_verifier):
    pairs = [(rf"\boxed{{{i}}}", str(i if i % 2 else i + 1)) for i in range(8)]
    first = math_verifier.check_batch(pairs, max_parallel=2)
    assert [r.reward for r in first] == [0.0 if i % 2 == 0 else 1.0 for i in range(8)]
    second = math_verifier.check_batch(pairs)
    assert all(r.cached for r in second)
    assert [r.reward for r in second] == [r.reward for r in first]
    # A different response with the same extracted answer hits the same cache entry.
    other = math_verifier.check(r"Long reasoning... hence \boxed{3}", "3")
    assert other.cached and other.reward == 1.0
    assert math_verifier.version == VERIFIER_VERSION and "math-verify" in VERIFIER_VERSION


def test_batch_from_many_threads(math_verifier):
    results: dict[int, list[MathResult]] = {}

    def worker(k: int) -> None:
        results[k] = math_verifier.check_batch([(rf"\boxed{{{k}/2}}", f"{k / 2}")])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[k][0].reward == 1.0 for k in range(1, 5))


@pytest.mark.slow
def test_pathological_expression_times_out_and_pool_recovers(math_verifier):
    replaced = math_verifier.workers_replaced
    hang = math_verifier.check(r"\boxed{9^{9^{9^{9}}}}", "1")  # sympy would never finish
    assert (hang.verdict, hang.reward) == ("timeout", 0.0)
    assert hang.wall_s < math_verifier.timeout_s + 2
    assert math_verifier.workers_replaced == replaced + 1
    again = math_verifier.check(r"\boxed{9^{9^{9^{9}}}}", "1")  # timeouts are not cached
    assert again.verdict == "timeout"
    after = math_verifier.check_batch([(r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{2}", "3")])
    assert [r.verdict for r in after] == ["correct", "incorrect"]


def test_bad_construction_arguments():
    with pytest.raises(ValueError, match="timeout_s"):
        MathVerifier(workers=1, timeout_s=0)
