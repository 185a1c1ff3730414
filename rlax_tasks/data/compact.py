"""The compact prompt format (``prompt_format: compact``) of the tiny character-level models.

A prompt is the arithmetic expression without spaces, then ``=`` (``"12+34="``); the answer is
the reference integer (``"46"``, the model then emits <eos>). The controller's prompt mixture
and the warm-up kit both render problems through it, so the two cannot drift apart."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

# bump when the text format changes: cached base models trained on the old format are rebuilt
FORMAT_VERSION = 1


class ArithmeticProblem(Protocol):
    """What the format reads of a problem (``rlax_tasks.rewards.tasks.Problem``; data sits
    below rewards, so it is named by its shape)."""

    id: str
    reference: str
    meta: Mapping[str, Any]


def compact_prompt(problem: ArithmeticProblem) -> str:
    """``"12+34="``: the problem's ``meta["expression"]`` without spaces, then ``=``."""
    expression = problem.meta.get("expression")
    if not isinstance(expression, str):
        raise ValueError(
            f"problem {problem.id!r} has no meta['expression']: it is not an arithmetic problem"
        )
    return expression.replace(" ", "") + "="


def compact_answer(problem: ArithmeticProblem) -> str:
    """``"46"``: the reference integer (the model then emits <eos>)."""
    return problem.reference
