"""``ToolEnvironment``: the Environment of tool-using tasks. Each turn's tool calls run and their
outputs are the observation; a turn without a call is the final answer, which ``score`` rates
(docs/design.md §15)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from rlax_tasks.environments import rows
from rlax_tasks.environments.base import StepResult
from rlax_tasks.environments.tool_calls import STYLES, parse_tool_calls
from rlax_tasks.environments.tools import Tool, run_tool


class ToolEnvironment:
    """Base of tool environments: subclasses give the tools and implement ``score``.

    Args:
      tools: the Tool objects the model may call (``self.tools`` holds their schemas).
      style: the tool-call syntax of turns (``tool_calls.STYLES``).
      system: a system prompt put before the row's prompt (unless it has its own).
    """

    required_keys: tuple[str, ...] = ("prompt",)

    def __init__(
        self, tools: Sequence[Tool], style: str = "hermes", system: str | None = None
    ) -> None:
        if style not in STYLES:
            raise ValueError(f"unknown tool-call style {style!r}; valid: {', '.join(STYLES)}")
        if system is not None and not isinstance(system, str):
            raise ValueError(f"system must be a string or null, got {system!r}")
        self.tool_objects = {t.name: t for t in tools}
        if len(self.tool_objects) != len(tools):
            raise ValueError(f"two tools share a name: {[t.name for t in tools]}")
        self.tools: list[dict] = [t.schema() for t in tools]
        self.style = style
        self.system = system
        self.row: dict[str, Any] = {}
        self.turns = 0

    def reset(self, row: dict) -> list[dict]:
        """Start an episode on ``row`` (``prompt`` and the subclass's ``required_keys``)."""
        self.row = rows.require(row, self.required_keys)
        self.turns = 0
        self.read_row(self.row)
        return rows.first_messages(self.row["prompt"], self.system)

    def read_row(self, row: dict) -> None:
        """Subclass hook: check and keep the task's fields of ``row`` (ValueError naming one)."""

    def step(self, turn: str) -> StepResult:
        """Run the turn's tool calls (observation: one tool message per call and per malformed
        call), or, without any call, score the turn as the final answer."""
        self.turns += 1
        parsed = parse_tool_calls(turn, self.style)
        if not parsed.calls and not parsed.errors:
            return StepResult((), done=True, reward=float(self.score(turn)), info=_counters())
        messages, failed, seconds = [], 0, 0.0
        for call in parsed.calls:
            start = time.monotonic()
            out = run_tool(self.tool_objects, call)
            seconds += time.monotonic() - start
            failed += out.error
            messages.append({"role": "tool", "name": call.name, "content": out.text})
        messages += [{"role": "tool", "name": "error", "content": e} for e in parsed.errors]
        info = _counters(
            len(parsed.calls) + len(parsed.errors),
            len(parsed.calls),
            failed + len(parsed.errors),
            seconds,
        )
        return StepResult(tuple(messages), done=False, reward=0.0, info=info)

    def score(self, final_turn: str) -> float:
        """The reward of the episode's final answer; subclasses implement it."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(final_turn)")


def _counters(
    calls: int = 0, valid: int = 0, errors: int = 0, seconds: float = 0.0
) -> dict[str, Any]:
    return {
        "tool_calls": calls,
        "valid_calls": valid,
        "tool_errors": errors,
        "tool_seconds": seconds,
    }
