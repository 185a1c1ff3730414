"""Scoring completions: math answers via math-verify, programs via the sandboxed judge under
each row's own test suite and limits; a broken row scores "verifier_error" alone."""

from __future__ import annotations

import json

import pytest

from rlax_tasks.rewards.sandbox import SandboxError, cxx_available
from rlax_tasks.rewards.scoring import extract_code, score_completions

pytestmark = pytest.mark.usefixtures("no_leftovers")

SUM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
SUM_CASES = [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"}]
SUM_SUITE = {"cases": SUM_CASES, "fn_name": None, "time_limit_s": None, "memory_mb": None}
CALL_SUITE = {
    "cases": [{"input": "[[1, 2, 3]]", "output": "[6]"}, {"input": "[[]]", "output": "[0]"}],
    "fn_name": "total",
}


def test_extract_code_takes_the_last_fenced_block():
    text = "first\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```\n"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"


def test_math_and_code_rows_are_scored_by_their_verifier():
    scores = score_completions(
        ["12", None],
        [None, SUM_CASES],
        [["so \\boxed{12}", "it is 13"], [SUM, "print(5)"]],
    )
    assert [s.reward for s in scores[0]] == [1.0, 0.0]
    assert scores[0][0].answer == "12" and scores[0][0].verdict == "correct"
    assert [s.reward for s in scores[1]] == [1.0, 0.0]
    assert scores[1][1].verdict == "wrong_answer" and scores[1][0].answer is None
    assert scores[1][1].detail == "test 1: wrong_answer" and scores[1][0].detail == ""


def test_tests_as_dict_json_string_or_legacy_list_and_call_based_rows():
    total = "```python\ndef total(xs):\n    print('thinking...')\n    return sum(xs)\n```"
    method = "class Solution:\n    def total(self, xs):\n        return float(sum(xs)) + 1e-9\n"
    scores = score_completions(
        [None] * 4,
        [SUM_SUITE, json.dumps(SUM_SUITE), SUM_CASES, CALL_SUITE],
        [[SUM], [SUM, "print(5)"], [SUM], [total, method, "def total(xs):\n    return 0\n"]],
    )
    assert [[s.verdict for s in row] for row in scores] == [
        ["pass"],
        ["pass", "wrong_answer"],
        ["pass"],
        ["pass", "pass", "wrong_answer"],
    ]
    assert scores[3][2].detail == "test 0: wrong_answer: expected [6], got 0"


# a program, its one test case, the suite's own limit, the default limit, and the verdicts
# (with the suite's limit, with the default)
LIMITS = {
    "time": (
        "import time\ntime.sleep(1.8)\nprint(int(input()) * 2)\n",
        {"input": "4", "output": "8"},
        {"time_limit_s": 0.5},
        {"timeout_s": 2.0},
        ["timeout", "pass"],
    ),
    "memory": (
        "x = bytearray(150 * 1024 * 1024)\nprint(len(x) // (1024 * 1024))\n",
        {"input": "", "output": "150"},
        {"memory_mb": 512},
        {"memory_mb": 96},
        ["pass", "memory"],
    ),
}


@pytest.mark.parametrize("limit", LIMITS)
def test_a_suite_limit_overrides_the_default(limit):
    program, case, suite_limit, default_limit, verdicts = LIMITS[limit]
    scores = score_completions(
        [None, None],
        [{"cases": [case], **suite_limit}, {"cases": [case]}],
        [[program], [program]],
        **default_limit,
    )
    assert [row[0].verdict for row in scores] == verdicts
    assert [row[0].reward for row in scores] == [float(v == "pass") for v in verdicts]


def test_broken_rows_score_verifier_error_and_the_others_are_judged():
    keyword_fn = {"cases": [{"input": "[1]", "output": "1"}], "fn_name": "lambda"}
    scores = score_completions(
        [None] * 5,
        ["not json", [], SUM_CASES, keyword_fn, CALL_SUITE],
        [["print(1)"], ["print(1)"], [SUM, "print(5)"], ["x = 1", "y = 2"], ["total = sum"]],
    )
    for row in (0, 1, 3):
        assert all(s.verdict == "verifier_error" and s.reward == 0.0 for s in scores[row])
    assert scores[0][0].detail.startswith("tests: not valid JSON")
    assert scores[1][0].detail == "tests: cases: no test cases"
    assert "fn_name: expected a Python identifier" in scores[3][1].detail
    assert [s.verdict for s in scores[2]] == ["pass", "wrong_answer"]
    assert [s.verdict for s in scores[4]] == ["pass"]


@pytest.mark.skipif(not cxx_available(), reason="g++ is not installed")
def test_call_based_rows_in_cpp_are_rejected_and_stdin_rows_still_run():
    cpp_sum = "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b;}\n"
    scores = score_completions(
        [None, None], [CALL_SUITE, SUM_CASES], [["int total();"], [cpp_sum]], language="cpp"
    )
    assert scores[0][0].verdict == "verifier_error" and "'cpp'" in scores[0][0].detail
    assert scores[1][0].verdict == "pass"


def test_a_broken_sandbox_is_raised_not_scored(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to be found
    with pytest.raises(SandboxError, match="bubblewrap"):
        score_completions([None, None], ["not json", SUM_CASES], [["x"], [SUM]])


def test_rows_without_reference_are_an_error():
    with pytest.raises(ValueError, match="row 0"):
        score_completions([None], [None], [["x"]])
    with pytest.raises(ValueError, match="differ in length"):
        score_completions(["1"], [], [["x"]])
