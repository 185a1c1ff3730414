"""The arithmetic task in the compact format a character-level model reads and writes.

The text format is ``rlax_tasks.data.compact`` ("12+34=" then "46<eos>"); prompts are encoded
like every other prompt text (no special tokens), so the evaluator, the controller and the
workers need no special case. Scoring is the task's own verifier (``ArithmeticTask.score``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from rlax_tasks.data.compact import compact_answer, compact_prompt
from rlax_tasks.rewards.tasks import ArithmeticTask, Problem

# the tiny-arith difficulty: a op b with 1-2 digit operands, + and - (answers -98..198)
DEFAULT_KNOBS: dict[str, Any] = {
    "min_digits": 1,
    "max_digits": 2,
    "num_operands": 2,
    "ops": ("+", "-"),
}


def _as_task(task: ArithmeticTask | dict[str, Any] | None) -> ArithmeticTask:
    if task is None:
        return ArithmeticTask(**DEFAULT_KNOBS)
    if isinstance(task, ArithmeticTask):
        return task
    if isinstance(task, dict):
        knobs = dict(task)
        if "ops" in knobs:
            knobs["ops"] = tuple(knobs["ops"])
        unknown = sorted(set(knobs) - {"min_digits", "max_digits", "num_operands", "ops"})
        if unknown:
            raise ValueError(
                f"unknown arithmetic knob(s) {unknown}; valid: max_digits, min_digits, "
                "num_operands, ops"
            )
        return ArithmeticTask(**knobs)
    raise ValueError(f"task must be an ArithmeticTask or a dict of its knobs, got {task!r}")


@dataclasses.dataclass(frozen=True)
class TinyArith:
    """Compact prompt/answer format and scorer over an ``ArithmeticTask`` (its knobs = difficulty).

    ``task`` may be given as an ``ArithmeticTask`` or a dict of its knobs.
    """

    task: ArithmeticTask = dataclasses.field(default_factory=lambda: _as_task(None))

    def __post_init__(self) -> None:
        object.__setattr__(self, "task", _as_task(self.task))

    # ------------------------------------------------------------------ text format
    prompt_text = staticmethod(compact_prompt)  # "12+34="
    answer_text = staticmethod(compact_answer)  # "46"

    def problems(self, n: int, seed: int) -> list[Problem]:
        """The first n problems of stream ``seed``, with the compact prompt in ``.prompt``."""
        return [self.compact(p) for p in self.task.generate(n, seed=seed)]

    def compact(self, problem: Problem) -> Problem:
        """The same problem with its prompt in the compact format (id, reference, meta kept)."""
        return dataclasses.replace(problem, prompt=self.prompt_text(problem))

    # ------------------------------------------------------------------ tokens
    @staticmethod
    def encode_prompt(tokenizer: Any, problem: Problem) -> list[int]:
        """Prompt token ids, encoded like any prompt text (no special tokens are added)."""
        return encode_text(tokenizer, TinyArith.prompt_text(problem))

    @staticmethod
    def encode_example(tokenizer: Any, problem: Problem) -> tuple[list[int], list[int]]:
        """(ids, target_mask) of prompt + answer + <eos>; the mask is 1 on answer and <eos>."""
        prompt = TinyArith.encode_prompt(tokenizer, problem)
        answer = [*encode_text(tokenizer, TinyArith.answer_text(problem)), tokenizer.eos_token_id]
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)

    def max_prompt_tokens(self) -> int:
        """Longest prompt of this difficulty, in tokens (one per character)."""
        t = self.task
        return t.num_operands * t.max_digits + (t.num_operands - 1) + 1

    def max_answer_tokens(self) -> int:
        """Longest answer of this difficulty including the sign and <eos>."""
        t = self.task
        largest = 10**t.max_digits - 1
        bound = largest**t.num_operands if "*" in t.ops else t.num_operands * largest
        return len(str(bound)) + 2

    # ------------------------------------------------------------------ reward
    def score(self, problem: Problem, response: str) -> float:
        """1.0 if the decoded completion's integer equals the reference (the task's verifier)."""
        return self.task.score(problem, response)

    def score_completions(
        self, tokenizer: Any, problems: Sequence[Problem], completions: Sequence[Sequence[int]]
    ) -> list[float]:
        """Rewards of completion token lists, one problem per completion."""
        if len(problems) != len(completions):
            raise ValueError(f"got {len(completions)} completions for {len(problems)} problems")
        return [
            self.score(p, tokenizer.decode(list(c), skip_special_tokens=True))
            for p, c in zip(problems, completions, strict=True)
        ]


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens; ValueError if a character is unknown."""
    try:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a plain Exception
        raise ValueError(f"the tokenizer cannot encode {text!r}: {exc}") from exc
    return [int(t) for t in ids]
