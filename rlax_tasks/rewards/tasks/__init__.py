"""Synthetic verifiable tasks for the embedded default: arithmetic and countdown."""

from __future__ import annotations

import dataclasses
from typing import Any

from rlax_tasks.rewards.tasks.arithmetic import ArithmeticTask
from rlax_tasks.rewards.tasks.base import Problem, Task
from rlax_tasks.rewards.tasks.countdown import CountdownTask

TASKS: dict[str, type] = {"arithmetic": ArithmeticTask, "countdown": CountdownTask}

__all__ = ["TASKS", "ArithmeticTask", "CountdownTask", "Problem", "Task", "make_task"]


def make_task(name: str, **knobs: Any) -> Task:
    """Build a task by name with difficulty knobs; unknown names or knobs raise ValueError."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; available: {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    fields = {f.name for f in dataclasses.fields(cls) if f.name != "name"}
    unknown = sorted(set(knobs) - fields)
    if unknown:
        raise ValueError(
            f"unknown knob(s) {', '.join(unknown)} for task {name!r}; "
            f"valid: {', '.join(sorted(fields))}"
        )
    if "ops" in knobs:
        knobs["ops"] = tuple(knobs["ops"])
    return cls(**knobs)
