"""The built-in environments (docs/design.md §15): "calculator" and "python" (math answers, with
tools) and "code" (a program judged against the row's tests, with feedback on failures)."""

from __future__ import annotations

import math
import time
from typing import Any

from rlax_tasks.data.code_tests import CodeCase, CodeTests
from rlax_tasks.environments import rows
from rlax_tasks.environments.base import StepResult
from rlax_tasks.environments.registry import register
from rlax_tasks.environments.tool_calls import parse_tool_calls
from rlax_tasks.environments.tool_env import ToolEnvironment
from rlax_tasks.environments.tools import Calculator, PythonTool, describe_run, truncate_text
from rlax_tasks.rewards import math as math_verifier
from rlax_tasks.rewards import sandbox
from rlax_tasks.rewards.judge import JudgeResult, TestVerdict, judge

CALCULATOR_SYSTEM = (
    "You may call the calculator tool for arithmetic. When you know the answer, reply without "
    "a tool call and end with the final answer in \\boxed{}."
)
PYTHON_SYSTEM = (
    "You may call the calculator tool for arithmetic and the python tool to run a program and "
    "see its output. When you know the answer, reply without a tool call and end with the final "
    "answer in \\boxed{}."
)
_FIELD_CHARS = 500  # of each input, expected output and error shown in the code feedback


class _MathAnswer(ToolEnvironment):
    """A math row ``{"prompt", "answer"}`` scored by ``rlax_tasks.rewards.math.verify``: the
    project's verifier for single-step math rows too (so one- and multi-turn rewards agree); it
    reads \\boxed{}, "the answer is" or the last number, compares equivalent forms (3/4 = 0.75)
    and runs in time-limited workers, unlike a bare last-number comparison."""

    required_keys = ("prompt", "answer")

    def read_row(self, row: dict) -> None:
        answer = row["answer"]
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise ValueError(f"the row's 'answer' must be a string or a number, got {answer!r}")
        self.answer = str(answer)

    def score(self, final_turn: str) -> float:
        return math_verifier.verify(final_turn, self.answer)


@register("calculator")
class CalculatorEnvironment(_MathAnswer):
    """A math problem with a calculator tool (Hermes tool calls)."""

    def __init__(self, system: str | None = CALCULATOR_SYSTEM) -> None:
        super().__init__([Calculator()], "hermes", system)


@register("python")
class PythonEnvironment(_MathAnswer):
    """A math problem with a calculator and a sandboxed Python tool (Hermes tool calls)."""

    def __init__(
        self, system: str | None = PYTHON_SYSTEM, timeout_s: float = 5.0, memory_mb: int = 512
    ) -> None:
        super().__init__([Calculator(), PythonTool(timeout_s, memory_mb)], "hermes", system)


@register("code")
class CodeEnvironment:
    """A programming problem ``{"prompt", "tests"}`` (``rlax_tasks.data.code_tests`` layout):
    each turn's last ```python block is judged on every test; all pass ends the episode with
    reward 1, otherwise the model sees up to ``show_failures`` failing tests (hidden ones
    without their data) and the step's reward is the fraction passed.

    Args:
      timeout_s, memory_mb: limits of one test run, unless the suite sets its own.
      show_failures: failing tests described in the feedback (>= 0).
      system: an optional system prompt.
    """

    tools: list[dict]

    def __init__(
        self,
        timeout_s: float = 2.0,
        memory_mb: int = 256,
        show_failures: int = 3,
        system: str | None = None,
    ) -> None:
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        _check_int("memory_mb", memory_mb, 16)
        _check_int("show_failures", show_failures, 0)
        self.timeout_s, self.memory_mb = float(timeout_s), memory_mb
        self.show_failures, self.system = show_failures, system
        self.tools = []
        self.suite: CodeTests | None = None

    def reset(self, row: dict) -> list[dict]:
        """Start an episode on ``row``; its ``tests`` must read as a CodeTests suite."""
        row = rows.require(row, ("prompt", "tests"))
        try:
            self.suite = CodeTests.from_value(row["tests"])
        except (ValueError, TypeError) as exc:  # FieldError is a ValueError
            raise ValueError(f"the row's 'tests' is not a test suite: {exc}") from None
        return rows.first_messages(row["prompt"], self.system)

    def step(self, turn: str) -> StepResult:
        """Judge the turn's last python block; feedback on failures, done when all pass."""
        if self.suite is None:
            raise RuntimeError("CodeEnvironment.step before reset(row)")
        parsed = parse_tool_calls(turn, "fenced")
        if not parsed.calls:
            text = "\n".join(["no python code block found", *parsed.errors])
            text += "; answer with the whole program in one ```python block"
            info = _info(0, len(parsed.errors), 0.0, 0, len(self.suite.cases))
            return StepResult(({"role": "user", "content": text},), False, 0.0, info)
        code = parsed.calls[-1].arguments["code"]
        start = time.monotonic()
        result = judge(
            code,
            [(c.input, c.output) for c in self.suite.cases],
            timeout_s=self._timeout_s,
            memory_mb=self._memory_mb,
            fn_name=self.suite.fn_name,
        )
        passed = sum(t.verdict == "pass" for t in result.tests)
        total = len(result.tests)
        info = _info(1, 0, time.monotonic() - start, passed, total)
        if result.reward == 1.0:
            return StepResult((), True, 1.0, info)
        feedback = self._feedback(code, self.suite, result)
        return StepResult(({"role": "user", "content": feedback},), False, passed / total, info)

    @property
    def _timeout_s(self) -> float:
        """One test run's time limit: the suite's own, else this environment's."""
        limit = self.suite.time_limit_s if self.suite is not None else None
        return limit or self.timeout_s

    @property
    def _memory_mb(self) -> int:
        """One test run's memory limit: the suite's own, else this environment's."""
        limit = self.suite.memory_mb if self.suite is not None else None
        return limit or self.memory_mb

    def _feedback(self, code: str, suite: CodeTests, result: JudgeResult) -> str:
        """The failing tests as the model reads them, then what to do."""
        failed = [t for t in result.tests if t.verdict != "pass"]
        lines = [f"{len(failed)} of {len(result.tests)} tests failed."]
        if result.compile_output:
            lines.append(f"compiler output:\n{_clip(result.compile_output)}")
        for test in failed[: self.show_failures]:
            lines.append(self._describe(code, suite, test))
        lines.append("Fix the program and answer with the whole program in one ```python block.")
        return "\n\n".join(lines)

    def _describe(self, code: str, suite: CodeTests, test: TestVerdict) -> str:
        """One failing test: its verdict, then (public tests only) input, expected, got/error."""
        case = suite.cases[test.index]
        head = f"Test {test.index + 1}: {test.verdict.replace('_', ' ')}"
        if not case.public:
            return f"{head} (a hidden test)"
        parts = [head, f"input:\n{_clip(case.input)}", f"expected:\n{_clip(case.output)}"]
        if test.verdict == "wrong_answer" and not suite.call_based:
            parts.append(f"got:\n{_clip(self._output(code, case))}")
        elif test.detail.strip():
            label = "result" if test.verdict == "wrong_answer" else "error"
            parts.append(f"{label}:\n{_clip(test.detail)}")
        elif test.verdict == "timeout":
            parts.append(f"error:\ntime limit {self._timeout_s:g} s exceeded")
        return "\n".join(parts)

    def _output(self, code: str, case: CodeCase) -> str:
        """The program's stdout on one failing test: the judge keeps verdicts, not outputs, so
        the shown test runs once more in the sandbox."""
        run = sandbox.run(code, "python", case.input, self._timeout_s, self._memory_mb)
        if run.ok:
            return run.stdout or "(no output)"
        return describe_run(run, self._timeout_s, self._memory_mb)


def _clip(text: str) -> str:
    return truncate_text(text.rstrip("\n"), _FIELD_CHARS)


def _check_int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _info(runs: int, errors: int, seconds: float, passed: int, total: int) -> dict[str, Any]:
    """The tool counters of a code step (a judged block is a call) and the tests passed."""
    return {
        "tool_calls": runs + errors,
        "valid_calls": runs,
        "tool_errors": errors,
        "tool_seconds": seconds,
        "tests_passed": passed,
        "tests_total": total,
    }
