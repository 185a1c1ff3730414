"""Tool calls in an assistant turn: parsed from the chat format's tool syntax, and rendered back.

Styles: "hermes" (Hermes/Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) and
"fenced" (each ```python / ```py / bare ``` block is a call of the "python" tool). Malformed
calls never raise: each becomes a short message the model sees (docs/design.md §15)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

STYLES = ("hermes", "fenced")
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_FENCE = "```"
_PYTHON_FENCES = ("", "python", "python3", "py")
_SHOWN_CHARS = 80  # of a malformed call, quoted in its error


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: dict


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """An assistant turn split into its well-formed calls, one error message per malformed
    call, and ``content``, the text outside every call."""

    calls: tuple[ToolCall, ...]
    errors: tuple[str, ...]
    content: str


def parse_tool_calls(text: str, style: str = "hermes") -> ParsedTurn:
    """The tool calls of ``text`` in ``style`` (one of STYLES); never raises on bad input."""
    if style == "hermes":
        return _parse_hermes(text)
    if style == "fenced":
        return _parse_fenced(text)
    raise ValueError(f"unknown tool-call style {style!r}; valid: {', '.join(STYLES)}")


def format_tool_call(call: ToolCall, style: str = "hermes") -> str:
    """``call`` as the model writes it in ``style`` (for tests, scripted policies, warm-up)."""
    if style == "hermes":
        body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
        return f"{OPEN_TAG}\n{body}\n{CLOSE_TAG}"
    if style == "fenced":
        code = call.arguments.get("code")
        if call.name != "python" or not isinstance(code, str):
            raise ValueError(
                f"the fenced style writes only python calls with a string 'code', got {call!r}"
            )
        return f"{_FENCE}python\n{code.rstrip(chr(10))}\n{_FENCE}"
    raise ValueError(f"unknown tool-call style {style!r}; valid: {', '.join(STYLES)}")


def _parse_hermes(text: str) -> ParsedTurn:
    calls: list[ToolCall] = []
    errors: list[str] = []
    outside: list[str] = []
    pos = 0
    while (start := text.find(OPEN_TAG, pos)) != -1:
        outside.append(text[pos:start])
        body_start = start + len(OPEN_TAG)
        end = text.find(CLOSE_TAG, body_start)
        index = len(calls) + len(errors) + 1
        if end == -1:
            errors.append(
                f"tool call {index}: {OPEN_TAG} is never closed; end each call with {CLOSE_TAG}"
            )
            pos = len(text)
            break
        call = _hermes_call(text[body_start:end], index)
        (calls if isinstance(call, ToolCall) else errors).append(call)
        pos = end + len(CLOSE_TAG)
    outside.append(text[pos:])
    return ParsedTurn(tuple(calls), tuple(errors), "".join(outside).strip())


def _hermes_call(body: str, index: int) -> ToolCall | str:
    """The call a ``<tool_call>`` body holds, or the error message that says what is wrong."""
    where = f"tool call {index}"
    example = '{"name": "<tool>", "arguments": {...}}'
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        return (
            f"{where}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}) in "
            f"{_shown(body)}; write {example}"
        )
    if not isinstance(obj, Mapping):
        return f"{where}: expected a JSON object {example}, got {_shown(body)}"
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'{where}: no "name" (a non-empty string) in {_shown(body)}; write {example}'
    arguments: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return f'{where} ({name}): "arguments" is a string but not JSON ({exc.msg})'
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, Mapping):
        return (
            f'{where} ({name}): "arguments" must be a JSON object of argument names to values, '
            f"got {_shown(json.dumps(arguments))}"
        )
    return ToolCall(name.strip(), dict(arguments))


def _parse_fenced(text: str) -> ParsedTurn:
    calls: list[ToolCall] = []
    errors: list[str] = []
    outside: list[str] = []
    pos = 0
    while (start := text.find(_FENCE, pos)) != -1:
        line_end = text.find("\n", start)
        if line_end == -1:  # a fence with nothing after it: not a block
            break
        language = text[start + len(_FENCE) : line_end].strip().lower()
        end = text.find(_FENCE, line_end + 1)
        if end == -1:
            if language in _PYTHON_FENCES:
                errors.append(
                    f"the ```{language} block is never closed; end it with ``` on its own line"
                )
                outside.append(text[pos:start])
                pos = len(text)
            break
        block_end = end + len(_FENCE)
        if language in _PYTHON_FENCES:
            outside.append(text[pos:start])
            calls.append(ToolCall("python", {"code": text[line_end + 1 : end]}))
        else:  # another language's block is content
            outside.append(text[pos:block_end])
        pos = block_end
    outside.append(text[pos:])
    return ParsedTurn(tuple(calls), tuple(errors), "".join(outside).strip())


def _shown(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _SHOWN_CHARS else text[:_SHOWN_CHARS] + "...")
