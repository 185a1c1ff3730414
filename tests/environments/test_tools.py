"""The built-in tools: the calculator's values, refusals and magnitude bounds; the python tool
through the real sandbox (output, an exception, a time-out, a flood of output); run_tool's error
outputs for unknown tools, bad arguments and a tool that raises."""

from __future__ import annotations

import shutil
import time

import pytest

from rlax_tasks.environments import Calculator, PythonTool, Tool, ToolCall, ToolOutput, run_tool


def calc(expression: object) -> ToolOutput:
    return run_tool(
        {"calculator": Calculator()}, ToolCall("calculator", {"expression": expression})
    )


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("7 / 2", "3.5"),
        ("6 / 3", "2"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("2 ** 10", "1024"),
        ("-(3 - 5) ** 2", "-4"),
        ("0.1 + 0.2", "0.3"),
        ("1.5e3 * 2", "3000"),
        ("2 ** -1", "0.5"),
        ("10 ** 50", "1" + "0" * 50),
        (42, "42"),
    ],
)
def test_the_calculator_computes(expression: object, value: str) -> None:
    assert calc(expression) == ToolOutput(value)


@pytest.mark.parametrize(
    "expression, words",
    [
        ("1 / 0", "division by zero"),
        ("__import__('os').system('true')", "Call is not allowed"),
        ("x + 1", "Name is not allowed"),
        ("'a' * 3", "only numbers"),
        ("2 ^ 3", "write **"),
        ("1 +", "cannot parse"),
        ("(-8) ** 0.5", "complex"),
        ("9 ** 9 ** 9", "result too large"),
        ("10 ** 999 * 10 ** 999", "result too large"),
        ("2.0 ** 5000", "result too large"),
        ("0.5 ** -5000", "result too large"),
        ("1e308 * 10", "not a finite number"),
        ("", "non-empty string"),
    ],
)
@pytest.mark.timeout(30, method="thread")  # an unbounded power would never return
def test_the_calculator_refuses_with_a_message(expression: str, words: str) -> None:
    start = time.monotonic()
    out = calc(expression)
    assert out.error and out.text.startswith("calculator: ") and words in out.text, out
    assert time.monotonic() - start < 1.0


def test_run_tool_names_an_unknown_tool_and_bad_arguments() -> None:
    tools = {"calculator": Calculator()}
    out = run_tool(tools, ToolCall("calculater", {"expression": "1"}))
    assert out == ToolOutput(
        "unknown tool 'calculater' (did you mean 'calculator'?); available tools: calculator", True
    )
    out = run_tool(tools, ToolCall("calculator", {}))
    assert out == ToolOutput(
        "calculator: missing argument 'expression'; it takes: expression", True
    )
    out = run_tool(tools, ToolCall("calculator", {"expression": "1", "expresion": "2"}))
    assert out.error and "unexpected argument 'expresion'" in out.text


class _Failing(Tool):
    name = "flaky"
    description = "raises, or talks too much"
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    max_output_chars = 100

    def execute(self, arguments: dict) -> ToolOutput:
        if arguments["n"] < 0:
            raise RuntimeError("negative n")
        return ToolOutput("x" * arguments["n"])


def test_a_tool_that_raises_is_an_error_output_and_long_output_is_cut() -> None:
    tools = {"flaky": _Failing()}
    out = run_tool(tools, ToolCall("flaky", {"n": -1}))
    assert out == ToolOutput("flaky: the tool failed: RuntimeError: negative n", True)
    assert run_tool(tools, ToolCall("flaky", {"n": 100})) == ToolOutput("x" * 100)
    out = run_tool(tools, ToolCall("flaky", {"n": 1000}))
    assert out.text == "x" * 50 + "\n[... 900 characters cut ...]\n" + "x" * 50
    assert _Failing().schema() == {
        "type": "function",
        "function": {
            "name": "flaky",
            "description": "raises, or talks too much",
            "parameters": _Failing.parameters,
        },
    }


@pytest.fixture(scope="module")
def python_tool() -> dict[str, Tool]:
    if shutil.which("bwrap") is None:
        pytest.fail("bubblewrap (bwrap) is not installed; run the project set-up")
    return {"python": PythonTool(timeout_s=1.0, memory_mb=256)}


def run_python(tools: dict[str, Tool], code: str) -> ToolOutput:
    return run_tool(tools, ToolCall("python", {"code": code}))


def test_python_returns_stdout_and_the_exit_status(python_tool) -> None:
    out = run_python(python_tool, "print(sum(range(10)))")
    assert not out.error
    assert out.text.startswith("exit code 0 (") and out.text.endswith("\nstdout:\n45\n")


def test_python_returns_an_exceptions_traceback(python_tool) -> None:
    out = run_python(python_tool, "print('before')\nraise KeyError('boom')")
    assert out.error
    assert out.text.startswith("exit code 1\nstdout:\nbefore\n\nstderr:\nTraceback")
    assert out.text.endswith("KeyError: 'boom'\n")


def test_python_stops_an_endless_loop(python_tool) -> None:
    start = time.monotonic()
    out = run_python(python_tool, "while True:\n    pass")
    assert out == ToolOutput("timed out after 1 s: the program was stopped\n(no output)", True)
    assert time.monotonic() - start < 10


def test_python_output_of_ten_megabytes_is_cut(python_tool) -> None:
    out = run_python(python_tool, "import sys\nsys.stdout.write('y' * 10_000_000)")
    assert out.error and out.text.startswith(
        "too much output: the program was stopped\nstdout:\nyyy"
    )
    assert "characters cut ...]" in out.text
    assert len(out.text) < 4100


def test_a_syntax_error_is_reported(python_tool) -> None:
    out = run_python(python_tool, "def f(:\n")
    assert out.error and out.text.startswith("syntax error") and "SyntaxError" in out.text
