"""Multi-digit arithmetic problems (the embedded default's task), deterministic by seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

from rlax_tasks.rewards.tasks.base import Problem
from rlax_tasks.rewards.tasks.extract import final_integer

_OPS = ("+", "-", "*")


def _evaluate(operands: list[int], ops: list[str]) -> int:
    """Value of `a op b op c ...` with the usual precedence (* before + and -)."""
    terms, signs, current = [], [1], operands[0]
    for op, value in zip(ops, operands[1:], strict=True):
        if op == "*":
            current *= value
        else:
            terms.append(current)
            signs.append(1 if op == "+" else -1)
            current = value
    terms.append(current)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


@dataclass(frozen=True)
class ArithmeticTask:
    """`a op b op ...` with operands of min_digits..max_digits digits; the knobs set difficulty."""

    min_digits: int = 1
    max_digits: int = 3
    num_operands: int = 2
    ops: tuple[str, ...] = _OPS
    name: str = "arithmetic"

    def __post_init__(self) -> None:
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits, got min_digits="
                f"{self.min_digits}, max_digits={self.max_digits}"
            )
        if self.num_operands < 2:
            raise ValueError(f"num_operands must be >= 2, got {self.num_operands}")
        bad = [op for op in self.ops if op not in _OPS]
        if bad or not self.ops:
            raise ValueError(f"ops must be a non-empty subset of {_OPS}, got {self.ops!r}")

    @classmethod
    def at_level(cls, level: int) -> ArithmeticTask:
        """Difficulty preset: level 1 = one-digit a+b ... level 5 = 5-digit, 4 operands."""
        if not 1 <= level <= 5:
            raise ValueError(f"level must be in 1..5, got {level}")
        return cls(
            min_digits=max(1, level - 1),
            max_digits=level,
            num_operands=2 + (level - 1) // 2,
            ops=_OPS if level > 1 else ("+", "-"),
        )

    def _operand(self, rng: random.Random) -> int:
        digits = rng.randint(self.min_digits, self.max_digits)
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)

    def generate(self, n: int, seed: int = 0) -> list[Problem]:
        """The first n problems for `seed`."""
        problems = []
        for i in range(n):
            rng = random.Random(f"arithmetic:{seed}:{i}")
            operands = [self._operand(rng) for _ in range(self.num_operands)]
            ops = [rng.choice(self.ops) for _ in range(self.num_operands - 1)]
            expr = " ".join(
                [str(operands[0])] + [f"{o} {v}" for o, v in zip(ops, operands[1:], strict=True)]
            )
            value = _evaluate(operands, ops)
            prompt = f"Compute {expr}. Put the final answer in \\boxed{{}}."
            problems.append(
                Problem(
                    self.name,
                    f"arithmetic-{seed}-{i}",
                    prompt,
                    str(value),
                    {"expression": expr, "operands": operands, "ops": ops},
                )
            )
        return problems

    def score(self, problem: Problem, response: str) -> float:
        """1.0 if the final integer in the response equals the reference."""
        answer = final_integer(response)
        return 1.0 if answer is not None and answer == int(problem.reference) else 0.0
