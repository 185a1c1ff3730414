"""The built-in environments through make_environment: a calculator episode (a tool call, then
a scored answer), malformed turns as observations, the python environment's tools, and the code
environment judging a wrong then a right program on a small real test suite."""

from __future__ import annotations

import shutil

import pytest

from rlax_tasks.environments import (
    Environment,
    EnvironmentSpec,
    StepResult,
    ToolCall,
    format_tool_call,
    make_environment,
)


@pytest.fixture(scope="module", autouse=True)
def _bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap (bwrap) is not installed; run the project set-up")


def make(name: str, **settings) -> Environment:
    return make_environment(EnvironmentSpec(name, settings=settings))


def call(name: str, **arguments) -> str:
    return format_tool_call(ToolCall(name, arguments))


def test_a_calculator_episode_calls_the_tool_then_scores_the_answer() -> None:
    env = make("calculator")
    assert [t["function"]["name"] for t in env.tools] == ["calculator"]
    first = env.reset({"prompt": "What is 123 * 456?", "answer": "56088"})
    assert [m["role"] for m in first] == ["system", "user"]
    assert "calculator" in first[0]["content"] and first[1]["content"] == "What is 123 * 456?"
    result = env.step("Let me compute.\n" + call("calculator", expression="123 * 456"))
    assert result.messages == ({"role": "tool", "name": "calculator", "content": "56088"},)
    assert (result.done, result.reward) == (False, 0.0)
    assert {k: result.info[k] for k in ("tool_calls", "valid_calls", "tool_errors")} == {
        "tool_calls": 1,
        "valid_calls": 1,
        "tool_errors": 0,
    }
    assert result.info["tool_seconds"] >= 0.0
    assert env.step("So the answer is \\boxed{56088}.") == StepResult(
        (), True, 1.0, {"tool_calls": 0, "valid_calls": 0, "tool_errors": 0, "tool_seconds": 0.0}
    )
    env.reset({"prompt": "What is 123 * 456?", "answer": "56088"})
    assert env.step("The answer is 56000.").reward == 0.0


def test_malformed_calls_and_tool_errors_are_observations_in_order() -> None:
    env = make("calculator", system=None)
    assert env.reset({"prompt": [{"role": "user", "content": "2/0?"}], "answer": "0"}) == [
        {"role": "user", "content": "2/0?"}
    ]
    turn = (
        call("calculator", expression="2/0")
        + call("calculator", expression="1+1")
        + '<tool_call>{"name": "calculator", "arguments": </tool_call>'
    )
    result = env.step(turn)
    assert not result.done and result.reward == 0.0
    assert [(m["role"], m["name"]) for m in result.messages] == [
        ("tool", "calculator"),
        ("tool", "calculator"),
        ("tool", "error"),
    ]
    assert result.messages[0]["content"] == "calculator: division by zero"
    assert result.messages[1]["content"] == "2"
    assert result.messages[2]["content"].startswith("tool call 3: not valid JSON")
    assert (result.info["tool_calls"], result.info["valid_calls"], result.info["tool_errors"]) == (
        3,
        2,
        2,
    )


def test_a_row_without_its_answer_is_named() -> None:
    with pytest.raises(ValueError, match=r"the row has no 'answer' \(this environment reads "):
        make("calculator").reset({"prompt": "1+1?"})
    with pytest.raises(ValueError, match=r"the row has no 'prompt'"):
        make("code").reset({"tests": []})
    with pytest.raises(ValueError, match=r"'tests' is not a test suite: cases: no test cases"):
        make("code").reset({"prompt": "x", "tests": []})


def test_the_python_environment_runs_code_and_lists_both_tools() -> None:
    env = make("python", timeout_s=2.0)
    assert [t["function"]["name"] for t in env.tools] == ["calculator", "python"]
    env.reset({"prompt": "What is the 10th Fibonacci number?", "answer": 55})
    code = "a, b = 0, 1\nfor _ in range(10):\n    a, b = b, a + b\nprint(a)"
    result = env.step(call("python", code=code))
    assert result.messages[0]["name"] == "python"
    assert result.messages[0]["content"].endswith("stdout:\n55\n")
    assert env.step("It is 55.").reward == 1.0


# A stdin problem: print the sum of two integers; the last test is hidden.
SUITE = {
    "cases": [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "5 0\n", "output": "5\n"},
        {"input": "10 -4\n", "output": "6\n"},
        {"input": "7 8\n", "output": "15\n", "public": False},
    ]
}
WRONG = "a, b = map(int, input().split())\nprint(a - b)\n"
RIGHT = "a, b = map(int, input().split())\nprint(a + b)\n"


def test_the_code_environment_gives_feedback_then_ends_on_a_right_program() -> None:
    env = make("code", timeout_s=2.0, show_failures=2)
    assert env.tools == []
    assert env.reset({"prompt": "Print a + b.", "tests": SUITE}) == [
        {"role": "user", "content": "Print a + b."}
    ]
    wrong = env.step(f"Here it is:\n```python\n{WRONG}```")
    assert not wrong.done
    assert wrong.reward == pytest.approx(1 / 4)  # only "5 0" passes
    assert (wrong.info["tests_passed"], wrong.info["tests_total"]) == (1, 4)
    (message,) = wrong.messages
    assert message["role"] == "user"
    assert message["content"] == (
        "3 of 4 tests failed.\n\n"
        "Test 1: wrong answer\ninput:\n1 2\nexpected:\n3\ngot:\n-1\n\n"
        "Test 3: wrong answer\ninput:\n10 -4\nexpected:\n6\ngot:\n14\n\n"
        "Fix the program and answer with the whole program in one ```python block."
    )
    right = env.step(f"```python\n{WRONG}```\nNo, this one:\n```python\n{RIGHT}```")
    assert (right.messages, right.done, right.reward) == ((), True, 1.0)


def test_code_feedback_shows_errors_and_hides_hidden_tests() -> None:
    env = make("code", show_failures=5)
    env.reset({"prompt": "Print a + b.", "tests": SUITE})
    result = env.step("```python\nraise SystemExit('no input handling yet')\n```")
    text = result.messages[0]["content"]
    assert result.reward == 0.0 and text.startswith("4 of 4 tests failed.")
    assert "Test 1: runtime error\ninput:\n1 2\nexpected:\n3\nerror:\nno input handling yet" in text
    assert "Test 4: runtime error (a hidden test)" in text and "7 8" not in text


def test_a_turn_without_code_asks_for_a_block() -> None:
    env = make("code")
    env.reset({"prompt": "Print a + b.", "tests": SUITE})
    result = env.step("I think you should add the numbers.")
    assert result.messages == (
        {
            "role": "user",
            "content": "no python code block found; answer with the whole program in one "
            "```python block",
        },
    )
    assert (result.done, result.reward) == (False, 0.0)


def test_call_based_suites_show_the_returned_value() -> None:
    env = make("code")
    suite = {"cases": [{"input": "[2, 3]", "output": "5"}], "fn_name": "add"}
    env.reset({"prompt": "Write add(a, b).", "tests": suite})
    result = env.step("```python\ndef add(a, b):\n    return a * b\n```")
    assert (
        "Test 1: wrong answer\ninput:\n[2, 3]\nexpected:\n5\nresult:\nexpected 5, got 6"
        in (result.messages[0]["content"])
    )
    assert env.step("```python\ndef add(a, b):\n    return a + b\n```").done
