"""Countdown problems: reach a target with given numbers and + - * /, deterministic by seed."""

from __future__ import annotations

import ast
import random
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction

from rlax_tasks.rewards.tasks.base import Problem
from rlax_tasks.rewards.tasks.extract import final_answer

_MAX_EXPR_CHARS = 300
_BINOPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


class _Rejected(ValueError):
    """The expression is not a valid countdown answer."""


def parse_expression(text: str) -> tuple[Fraction, list[int]]:
    """Exact value and the integers used by an expression of ints, + - * / and parentheses;
    anything else (names, powers, calls, floats) is rejected with ValueError."""
    if len(text) > _MAX_EXPR_CHARS:
        raise _Rejected(f"expression longer than {_MAX_EXPR_CHARS} characters")
    text = text.replace("×", "*").replace("÷", "/").replace("−", "-").strip()
    if "=" in text:  # "expr = target": judge the left side
        text = text.split("=", 1)[0]
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as exc:
        raise _Rejected(f"not an expression: {exc}") from exc
    used: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left, right = value(node.left), value(node.right)
            op = _BINOPS[type(node.op)]
            if op == "+":
                return left + right
            if op == "-":
                return left - right
            if op == "*":
                return left * right
            if right == 0:
                raise _Rejected("division by zero")
            return left / right
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise _Rejected(f"disallowed syntax: {type(node).__name__}")

    return value(tree.body), used


@dataclass(frozen=True)
class CountdownTask:
    """Numbers in 1..max_number (num_numbers of them) and a reachable target <= max_target."""

    num_numbers: int = 4
    max_number: int = 25
    max_target: int = 1000
    use_all: bool = True
    name: str = "countdown"

    def __post_init__(self) -> None:
        if self.num_numbers < 2:
            raise ValueError(f"num_numbers must be >= 2, got {self.num_numbers}")
        if self.max_number < 2:
            raise ValueError(f"max_number must be >= 2, got {self.max_number}")
        if self.max_target < 1:
            raise ValueError(f"max_target must be >= 1, got {self.max_target}")

    def _solution(self, rng: random.Random, numbers: list[int]) -> tuple[int, str] | None:
        items = [(Fraction(n), str(n)) for n in numbers]
        rng.shuffle(items)
        while len(items) > 1:
            (a, ea), (b, eb) = items.pop(), items.pop()
            choices = ["+", "*", "-", "/"]
            rng.shuffle(choices)
            for op in choices:
                if op == "-" and a < b:
                    a, b, ea, eb = b, a, eb, ea
                if op == "/" and (b == 0 or a % b != 0):
                    continue
                value = {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else None}[op]
                if value is not None and 0 < value <= self.max_target:
                    items.insert(rng.randrange(len(items) + 1), (value, f"({ea} {op} {eb})"))
                    break
            else:
                return None
        value, expr = items[0]
        return int(value), expr[1:-1]

    def generate(self, n: int, seed: int = 0) -> list[Problem]:
        """The first n problems for `seed`; each has a known solution in meta["solution"]."""
        problems = []
        for i in range(n):
            rng = random.Random(f"countdown:{seed}:{i}")
            for _ in range(10_000):
                numbers = [rng.randint(1, self.max_number) for _ in range(self.num_numbers)]
                found = self._solution(rng, numbers)
                if found is not None:
                    break
            else:  # pragma: no cover - unreachable with validated knobs
                raise RuntimeError("could not generate a countdown problem")
            target, solution = found
            rule = "each number exactly once" if self.use_all else "each number at most once"
            prompt = (
                f"Using the numbers {numbers}, write an arithmetic expression that equals "
                f"{target}. You may use +, -, *, / and parentheses, {rule}. Give the "
                f"expression inside <answer></answer>, e.g. <answer>(1 + 2) * 3</answer>."
            )
            problems.append(
                Problem(
                    self.name,
                    f"countdown-{seed}-{i}",
                    prompt,
                    str(target),
                    {
                        "numbers": numbers,
                        "target": target,
                        "solution": solution,
                        "use_all": self.use_all,
                    },
                )
            )
        return problems

    def score(self, problem: Problem, response: str) -> float:
        """1.0 if the answer expression equals the target and uses the numbers legally."""
        expr = final_answer(response)
        if expr is None:
            return 0.0
        try:
            value, used = parse_expression(expr)
        except (ValueError, RecursionError, MemoryError):
            return 0.0
        numbers = Counter(problem.meta["numbers"])
        used_count = Counter(used)
        legal = (
            used_count == numbers
            if problem.meta.get("use_all", True)
            else all(used_count[k] <= numbers[k] for k in used_count)
        )
        return 1.0 if legal and value == int(problem.reference) else 0.0
