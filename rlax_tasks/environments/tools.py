"""Tools a model calls in an episode: the ``Tool`` base, the built-in ``Calculator`` and
``PythonTool``, and ``run_tool``, which turns every failure into an error observation
(docs/design.md §15)."""

from __future__ import annotations

import abc
import ast
import logging
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlax_tasks.environments.tool_calls import ToolCall
from rlax_tasks.rewards import sandbox
from rlax_tasks.utils.validation import did_you_mean

logger = logging.getLogger(__name__)

MAX_OUTPUT_CHARS = 4000


@dataclass(frozen=True)
class ToolOutput:
    """What a tool call returns to the model; ``error`` marks a failed call."""

    text: str
    error: bool = False


def truncate_text(text: str, limit: int) -> str:
    """``text`` cut to its first and last ``limit // 2`` characters around a marker that says
    how many were cut (the tail often holds the error)."""
    if len(text) <= limit:
        return text
    head, tail = limit - limit // 2, limit // 2
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut ...]\n{text[len(text) - tail :]}"


class Tool(abc.ABC):
    """A function the model may call: ``name``, ``description`` and a JSON-schema
    ``parameters``; subclasses implement ``execute``, and ``run`` bounds its output."""

    name: str
    description: str
    parameters: dict
    max_output_chars: int = MAX_OUTPUT_CHARS

    def schema(self) -> dict:
        """The OpenAI/transformers function schema that chat templates list."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def run(self, arguments: Mapping[str, Any]) -> ToolOutput:
        """``execute`` with its text cut to ``max_output_chars``."""
        out = self.execute(dict(arguments))
        return ToolOutput(truncate_text(out.text, self.max_output_chars), out.error)

    @abc.abstractmethod
    def execute(self, arguments: dict) -> ToolOutput:
        """Run the call; a problem the model caused is an error ToolOutput, not an exception."""


def run_tool(tools: Mapping[str, Tool], call: ToolCall) -> ToolOutput:
    """The output of ``call``; an unknown tool, a missing or extra argument and an exception
    inside the tool are error outputs naming the tool and the problem, never exceptions."""
    tool = tools.get(call.name)
    if tool is None:
        names = sorted(tools)
        return ToolOutput(
            f"unknown tool {call.name!r}{did_you_mean(call.name, names)}; available tools: "
            f"{', '.join(names) or '(none)'}",
            error=True,
        )
    problem = _argument_problem(tool, call.arguments)
    if problem:
        return ToolOutput(f"{tool.name}: {problem}", error=True)
    try:
        out = tool.run(call.arguments)
    except Exception as exc:  # noqa: BLE001 - a tool failure is an observation
        logger.warning("tool %s failed on %r", tool.name, call.arguments, exc_info=True)
        return ToolOutput(f"{tool.name}: the tool failed: {type(exc).__name__}: {exc}", True)
    if not isinstance(out, ToolOutput):
        logger.warning("tool %s returned %r, not a ToolOutput", tool.name, type(out).__name__)
        return ToolOutput(f"{tool.name}: the tool returned no output", error=True)
    if isinstance(tool, Tool):  # Tool.run has cut it
        return out
    limit = getattr(tool, "max_output_chars", MAX_OUTPUT_CHARS)
    return ToolOutput(truncate_text(out.text, limit), out.error)


def _argument_problem(tool: Tool, arguments: Mapping[str, Any]) -> str:
    """What is wrong with ``arguments`` for the tool's schema (required, unknown), or ""."""
    schema = getattr(tool, "parameters", None) or {}
    properties = schema.get("properties", {})
    missing = [n for n in schema.get("required", []) if n not in arguments]
    if missing:
        return f"missing argument {missing[0]!r}; it takes: {', '.join(properties) or '(none)'}"
    if schema.get("additionalProperties", False) is not True:
        for key in arguments:
            if key not in properties:
                return (
                    f"unexpected argument {key!r}{did_you_mean(key, properties)}; it takes: "
                    f"{', '.join(properties) or '(none)'}"
                )
    return ""


# ----------------------------------------------------------------------------- calculator

_MAX_EXPRESSION_CHARS = 1000
_MAX_DIGITS = 1000  # |result| < 10**_MAX_DIGITS: bounds time and memory of every operation
_MAX_BITS = int(_MAX_DIGITS * math.log2(10))
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate; the message says why."""


class Calculator(Tool):
    """Arithmetic on ints and floats (+ - * / // % ** and parentheses), evaluated from the
    syntax tree: no names, calls or attributes, and bounded magnitudes, so nothing hangs."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression with + - * / // % ** and parentheses, "
        "e.g. '(17 + 25) * 3'."
    )
    parameters = {
        "type": "object",
        "properties": {
            "expression": {"type": "string", "description": "the expression to evaluate"}
        },
        "required": ["expression"],
    }

    def __init__(self, max_output_chars: int = MAX_OUTPUT_CHARS) -> None:
        self.max_output_chars = max_output_chars

    def execute(self, arguments: dict) -> ToolOutput:
        try:
            return ToolOutput(format_number(evaluate(arguments["expression"])))
        except CalculatorError as exc:
            return ToolOutput(f"calculator: {exc}", error=True)


def evaluate(expression: Any) -> int | float:
    """The value of an arithmetic expression; CalculatorError says what is not allowed."""
    if isinstance(expression, int | float) and not isinstance(expression, bool):
        expression = repr(expression)
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError(f"expression must be a non-empty string, got {expression!r}")
    if len(expression) > _MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {_MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise CalculatorError(f"cannot parse {expression!r}: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise CalculatorError("expression nested too deeply") from None
    try:
        return _eval(tree.body)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except OverflowError:
        raise CalculatorError(f"result too large (limit 1e{_MAX_DIGITS})") from None
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def format_number(value: int | float) -> str:
    """An int as is, a float with 15 significant digits ("2" for 6 / 3, "0.3" for 0.1 + 0.2)."""
    return str(value) if isinstance(value, int) else format(value, ".15g")


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return _bounded(node.value)
        raise CalculatorError(f"only numbers are allowed, got {node.value!r}")
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _bounded(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("'^' is not a power here; write ** (2**10)")
    raise CalculatorError(
        f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses"
    )


def _check_power(base: int | float, exponent: int | float) -> None:
    """Refuse a power whose result would exceed the magnitude bound, before computing it."""
    if base != 0 and exponent * math.log10(abs(base)) >= _MAX_DIGITS:
        raise CalculatorError(f"result too large (limit 1e{_MAX_DIGITS})")


def _bounded(value: Any) -> int | float:
    if isinstance(value, complex):
        raise CalculatorError("the result is a complex number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise CalculatorError(f"result too large (limit 1e{_MAX_DIGITS})")
    return value


# ----------------------------------------------------------------------------- python

# enough for any output a model can read, small enough that a print loop stops quickly
_SANDBOX = sandbox.SandboxConfig(output_limit_bytes=1 << 20)


class PythonTool(Tool):
    """Runs a Python program in the sandbox (``rlax_tasks.rewards.sandbox``: no network, CPU,
    wall and memory limits) and returns its stdout, stderr and exit status as text."""

    name = "python"
    description = (
        "Run a Python 3 program and see its output; print what you want to see. "
        "No network, no files kept between calls."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the program to run"}},
        "required": ["code"],
    }

    def __init__(
        self, timeout_s: float = 5.0, memory_mb: int = 512, max_output_chars: int = MAX_OUTPUT_CHARS
    ) -> None:
        if not (isinstance(timeout_s, int | float) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not isinstance(memory_mb, int) or memory_mb < 16:
            raise ValueError(f"memory_mb must be an integer >= 16, got {memory_mb!r}")
        self.timeout_s, self.memory_mb = float(timeout_s), memory_mb
        self.max_output_chars = max_output_chars

    def execute(self, arguments: dict) -> ToolOutput:
        code = arguments["code"]
        if not isinstance(code, str):
            return ToolOutput(f"python: code must be a string, got {type(code).__name__}", True)
        result = sandbox.run(
            code, "python", timeout_s=self.timeout_s, memory_mb=self.memory_mb, config=_SANDBOX
        )
        return ToolOutput(describe_run(result, self.timeout_s, self.memory_mb), not result.ok)


def describe_run(result: sandbox.ExecResult, timeout_s: float, memory_mb: int) -> str:
    """A sandboxed run as the model reads it: the verdict line, then stdout and stderr."""
    verdicts = {
        "ok": f"exit code 0 ({result.wall_s:.2f} s)",
        "timeout": f"timed out after {timeout_s:g} s: the program was stopped",
        "memory": f"out of memory (limit {memory_mb} MB)",
        "runtime_error": f"exit code {result.exit_code}",
        "compile_error": "syntax error: the program did not run",
        "output_limit": "too much output: the program was stopped",
    }
    parts = [verdicts.get(result.status, result.status)]
    if result.stdout:
        parts.append(f"stdout:\n{result.stdout}")
    if result.stderr:
        parts.append(f"stderr:\n{result.stderr}")
    if len(parts) == 1:
        parts.append("(no output)")
    return "\n".join(parts)
