"""Scoring completions: math answers via math-verify, programs via the sandboxed judge."""

import pytest

from rlax_tasks.evaluation.scoring import extract_code, score_completions


def test_extract_code_takes_the_last_fenced_block():
    text = "first\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```\n"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("print(3)") == "print(3)"


def test_math_and_code_rows_are_scored_by_their_verifier():
    solution = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    scores = score_completions(
        ["12", None],
        [None, [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"}]],
        [["so \\boxed{12}", "it is 13"], [solution, "print(5)"]],
    )
    assert [s.reward for s in scores[0]] == [1.0, 0.0]
    assert scores[0][0].answer == "12" and scores[0][0].verdict == "correct"
    assert [s.reward for s in scores[1]] == [1.0, 0.0]
    assert scores[1][1].verdict == "wrong_answer" and scores[1][0].answer is None


def test_rows_without_reference_are_an_error():
    with pytest.raises(ValueError, match="row 0"):
        score_completions([None], [None], [["x"]])
    with pytest.raises(ValueError, match="differ in length"):
        score_completions(["1"], [], [["x"]])
