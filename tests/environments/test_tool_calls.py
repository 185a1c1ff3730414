"""Parsing tool calls out of assistant turns: well-formed ones (one, several, arguments as a JSON
string), each kind of malformed one as a message (never an exception), and rendering back."""

from __future__ import annotations

import pytest

from rlax_tasks.environments import ToolCall, format_tool_call, parse_tool_calls


def test_one_hermes_call_and_the_text_around_it() -> None:
    text = (
        "I will compute it.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>\nThen done.'
    )
    parsed = parse_tool_calls(text)
    assert parsed.calls == (ToolCall("calculator", {"expression": "2 + 3"}),)
    assert parsed.errors == ()
    assert parsed.content == "I will compute it.\n\nThen done."


def test_several_calls_and_arguments_given_as_a_json_string() -> None:
    text = (
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'
        '</tool_call><tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    )
    parsed = parse_tool_calls(text, "hermes")
    assert parsed.calls == (
        ToolCall("calculator", {"expression": "1+1"}),
        ToolCall("python", {"code": "print(1)"}),
    )
    assert (parsed.errors, parsed.content) == ((), "")


def test_a_turn_without_calls_is_all_content() -> None:
    parsed = parse_tool_calls("The answer is 42.")
    assert (parsed.calls, parsed.errors, parsed.content) == ((), (), "The answer is 42.")


@pytest.mark.parametrize(
    "body, words",
    [
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not valid JSON"),
        ('["calculator"]', "expected a JSON object"),
        ('{"arguments": {"expression": "1"}}', 'no "name"'),
        ('{"name": "", "arguments": {}}', 'no "name"'),
        ('{"name": "calculator", "arguments": [1, 2]}', '"arguments" must be a JSON object'),
        ('{"name": "calculator", "arguments": "[1, 2]"}', '"arguments" must be a JSON object'),
        ('{"name": "calculator", "arguments": "{oops"}', "is a string but not JSON"),
    ],
)
def test_each_malformed_call_is_an_error_message(body: str, words: str) -> None:
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}</tool_call>'
    parsed = parse_tool_calls(f"first {good} then <tool_call>{body}</tool_call>")
    assert parsed.calls == (ToolCall("calculator", {"expression": "2"}),)
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith("tool call 2")
    assert words in parsed.errors[0]


def test_an_unclosed_call_is_an_error() -> None:
    parsed = parse_tool_calls('Let me see <tool_call>{"name": "calculator", "arguments": {}}')
    assert parsed.calls == ()
    assert parsed.errors == (
        "tool call 1: <tool_call> is never closed; end each call with </tool_call>",
    )
    assert parsed.content == "Let me see"


def test_missing_arguments_are_an_empty_object() -> None:
    assert parse_tool_calls('<tool_call>{"name": "now"}</tool_call>').calls == (
        ToolCall("now", {}),
    )


def test_fenced_python_blocks_are_python_calls_and_other_languages_are_content() -> None:
    text = (
        "Try:\n```python\nprint(1)\n```\nor\n```py\nprint(2)\n```\n"
        "```\nprint(3)\n```\n```bash\nls\n```\nend"
    )
    parsed = parse_tool_calls(text, "fenced")
    assert [c.arguments["code"] for c in parsed.calls] == ["print(1)\n", "print(2)\n", "print(3)\n"]
    assert {c.name for c in parsed.calls} == {"python"}
    assert parsed.errors == ()
    assert parsed.content == "Try:\n\nor\n\n\n```bash\nls\n```\nend"


def test_an_unclosed_fence_is_an_error() -> None:
    parsed = parse_tool_calls("Here:\n```python\nprint(1)\n", "fenced")
    assert parsed.calls == ()
    assert parsed.errors == (
        "the ```python block is never closed; end it with ``` on its own line",
    )


def test_format_renders_calls_that_parse_back() -> None:
    call = ToolCall("calculator", {"expression": "2 ** 10", "note": "é"})
    assert parse_tool_calls(format_tool_call(call)).calls == (call,)
    code = ToolCall("python", {"code": "x = 1\nprint(x)\n"})
    assert format_tool_call(code, "fenced") == "```python\nx = 1\nprint(x)\n```"
    assert parse_tool_calls(format_tool_call(code, "fenced"), "fenced").calls == (code,)
    with pytest.raises(ValueError, match="fenced style writes only python calls"):
        format_tool_call(call, "fenced")
    with pytest.raises(ValueError, match="unknown tool-call style 'xml'; valid: hermes, fenced"):
        parse_tool_calls("", "xml")
