"""Judging programs on test cases: comparisons, checker programs, per-test verdicts."""

from __future__ import annotations

import pytest

from rlax_tasks.rewards.judge import (
    Checker,
    Submission,
    TestCase,
    judge,
    judge_batch,
    outputs_match,
)
from rlax_tasks.rewards.sandbox import cxx_available

pytestmark = pytest.mark.usefixtures("no_leftovers")

SUM = "a, b = map(int, input().split())\nprint(a + b)\n"
TESTS = [TestCase("1 2\n", "3\n"), TestCase("10 -4\n", "6\n"), ("0 0\n", "0\n")]


def test_correct_program_passes_every_test():
    result = judge(SUM, TESTS)
    assert (result.reward, result.verdict) == (1.0, "pass")
    assert [t.verdict for t in result.tests] == ["pass"] * 3
    assert [t.index for t in result.tests] == [0, 1, 2]


def test_one_failing_test_gives_zero_reward_and_verdicts_are_kept():
    buggy = "a, b = map(int, input().split())\nprint(a + b if a != 10 else 0)\n"
    result = judge(buggy, TESTS)
    assert result.reward == 0.0 and result.verdict == "wrong_answer"
    assert [t.verdict for t in result.tests] == ["pass", "wrong_answer", "pass"]


def test_failures_per_test_keep_the_sandbox_status():
    src = (
        "import sys\n"
        "n = int(input())\n"
        "if n == 1:\n    while True: pass\n"
        "if n == 2:\n    raise SystemExit(4)\n"
        "print(n)\n"
    )
    result = judge(src, [("0", "0"), ("1", "1"), ("2", "2")], timeout_s=1.0)
    assert [t.verdict for t in result.tests] == ["pass", "timeout", "runtime_error"]
    assert result.reward == 0.0 and result.verdict == "timeout"


def test_exact_versus_token_comparison():
    sloppy = "print('3 ')\nprint()\n"
    assert judge(sloppy, [("", "3\n")], comparison="tokens").reward == 1.0
    assert judge(sloppy, [("", "3\n")], comparison="exact").reward == 0.0
    assert outputs_match("1  2\n3", "1 2 3", "tokens") and not outputs_match("12", "1 2")
    with pytest.raises(ValueError, match="'fuzzy'"):
        outputs_match("a", "a", "fuzzy")
    with pytest.raises(ValueError, match="'fuzzy'"):
        judge(SUM, TESTS, comparison="fuzzy")
    with pytest.raises(ValueError, match="'brainfuck'"):
        judge(SUM, TESTS, language="brainfuck")


CHECKER = """
import sys
inp, expected, output = (open(p).read() for p in sys.argv[1:4])
n = int(inp)
try:
    d = int(output.split()[0])
except (ValueError, IndexError):
    sys.exit(1)
sys.exit(0 if 1 < d < n and n % d == 0 else 1)
"""


def test_checker_program_accepts_any_valid_answer():
    smallest = "n = int(input())\nprint(next(d for d in range(2, n) if n % d == 0))\n"
    largest = "n = int(input())\nprint(max(d for d in range(2, n) if n % d == 0))\n"
    wrong = "print(1)\n"
    tests = [("12", "2"), ("35", "5")]
    checker = Checker(CHECKER)
    results = judge_batch(
        [
            Submission(smallest, tests, checker=checker),
            Submission(largest, tests, checker=checker),
            Submission(wrong, tests, checker=checker),
        ]
    )
    assert [r.reward for r in results] == [1.0, 1.0, 0.0]
    assert [t.verdict for t in results[2].tests] == ["wrong_answer", "wrong_answer"]


def test_broken_checker_is_flagged():
    result = judge("print(1)", [("", "1")], checker=Checker("import sys\nsys.exit(7)"))
    assert result.reward == 0.0 and result.tests[0].verdict == "checker_error"


@pytest.mark.skipif(not cxx_available(), reason="g++ is not installed")
def test_cpp_submission_and_compile_error():
    src = "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}"
    good, bad = judge_batch(
        [
            Submission(src, tuple(TESTS), language="cpp"),
            Submission("int main({", tuple(TESTS), language="cpp"),
        ]
    )
    assert good.reward == 1.0
    assert bad.reward == 0.0 and bad.verdict == "compile_error"
    assert {t.verdict for t in bad.tests} == {"compile_error"} and bad.compile_output


def test_submission_needs_tests():
    with pytest.raises(ValueError, match="at least one test"):
        judge(SUM, [])


# Call-based judging: `input` is the JSON argument list, `expected` the JSON return value.
TWO_SUM_TESTS = [("[[2, 7, 11, 15], 9]", "[0, 1]"), ("[[3, 2, 4], 6]", "[1, 2]")]
TWO_SUM = """
def twoSum(nums, target):
    seen = {}
    for i, x in enumerate(nums):
        if target - x in seen:
            return (seen[target - x], i)  # a tuple: compared as a list
        seen[x] = i
"""
CHATTY_TWO_SUM = """
print("debug", 1)
def twoSum(nums, target):
    print([0, 1])
    print([1, 2])
    return next([i, j] for j in range(len(nums)) for i in range(j) if nums[i] + nums[j] == target)
"""
SOLUTION_TWO_SUM = """
class Solution:
    def twoSum(self, nums, target):
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return [seen[target - x], i]
            seen[x] = i
"""
WRONG_TWO_SUM = "def twoSum(nums, target):\n    return [1, 0]\n"


def test_call_based_top_level_function_and_class_solution():
    results = judge_batch(
        [
            Submission(src, TWO_SUM_TESTS, fn_name="twoSum")
            for src in (TWO_SUM, CHATTY_TWO_SUM, SOLUTION_TWO_SUM, WRONG_TWO_SUM)
        ]
    )
    assert [r.reward for r in results] == [1.0, 1.0, 1.0, 0.0]
    assert [t.verdict for t in results[3].tests] == ["wrong_answer", "wrong_answer"]
    assert results[3].tests[0].detail == "expected [0, 1], got [1, 0]"


def test_call_based_source_is_imported_so_its_main_block_does_not_run():
    # a solution written to be run as a script too: its main block would read the arguments
    src = (
        "def add(a, b):\n    return a + b\n\n"
        'if __name__ == "__main__":\n    print(add(*map(int, input().split())))\n'
    )
    result = judge(src, [("[1, 2]", "[3]"), ("[5, 5]", "10")], fn_name="add")
    assert [t.verdict for t in result.tests] == ["pass", "pass"]


def test_call_based_comparison_of_return_values():
    src = "def f(x):\n    return x\n"
    cases = [
        ("[3]", "[3]"),  # APPS wraps the return value once: 3 stands for [3]
        ("[[0, 1]]", "[[0, 1]]"),  # ... and [0, 1] for [[0, 1]]
        ("[[3]]", "[3]"),  # the unwrapped value itself still counts
        ("[0.33333333]", "0.3333333333"),  # floats within 1e-6
        ("[1e-9]", "0"),
        ("[0.334]", "0.3333333333"),
        ("[1]", "[1, 1]"),  # only a one-element list is unwrapped
        ("[[3]]", "3"),  # and only the expected value
        ("[1]", "true"),  # JSON booleans are not numbers
        ('[{"a": [1.0, null]}]', '{"a": [1, null]}'),
    ]
    result = judge(src, cases, fn_name="f")
    verdicts = [t.verdict for t in result.tests]
    assert verdicts == ["pass"] * 5 + ["wrong_answer"] * 4 + ["pass"]


def test_call_based_failures_have_a_clear_verdict():
    tests = [("[1]", "1")]
    missing, raises, exits, unserializable = judge_batch(
        [
            Submission("def g(x):\n    return x\n", tests, fn_name="f"),
            Submission("def f(x):\n    return 1 // 0\n", tests, fn_name="f"),
            Submission("import sys\ndef f(x):\n    return x\nsys.exit(0)\n", tests, fn_name="f"),
            Submission("def f(x):\n    return {x}\n", tests, fn_name="f"),
        ]
    )
    assert missing.verdict == "runtime_error"
    assert "no function 'f' and no method Solution.f" in missing.tests[0].detail
    assert raises.verdict == "runtime_error" and "ZeroDivisionError" in raises.tests[0].detail
    assert exits.verdict == "wrong_answer" and "no return value" in exits.tests[0].detail
    assert unserializable.verdict == "runtime_error"
    assert "not JSON" in unserializable.tests[0].detail


def test_call_based_submissions_are_checked_before_running():
    with pytest.raises(ValueError, match="'cpp'"):
        judge("int f(int x) { return x; }", [("[1]", "1")], language="cpp", fn_name="f")
    with pytest.raises(ValueError, match="test 1: call-based input is not valid JSON"):
        judge("def f(x): return x", [("[1]", "1"), ("1 2", "3")], fn_name="f")
    with pytest.raises(ValueError, match="JSON list of arguments"):
        judge("def f(x): return x", [("{}", "1")], fn_name="f")
    with pytest.raises(ValueError, match="identifier"):
        judge("def f(x): return x", [("[1]", "1")], fn_name="class")
