"""Common types of the synthetic verifiable tasks: a generated problem and the task protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Problem:
    """One generated prompt with what is needed to score a response to it."""

    task: str
    id: str
    prompt: str
    reference: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False)


@runtime_checkable
class Task(Protocol):
    """A generator of problems (deterministic by seed) and their verifier."""

    name: str

    def generate(self, n: int, seed: int = 0) -> list[Problem]:
        """The first n problems of the stream for `seed` (a prefix is stable as n grows)."""
        ...

    def score(self, problem: Problem, response: str) -> float:
        """1.0 if the response solves the problem, else 0.0."""
        ...
