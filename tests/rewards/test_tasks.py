"""Synthetic tasks: deterministic generation, difficulty knobs, and their verifiers."""

from __future__ import annotations

import pytest

from rlax_tasks.rewards.tasks import (
    ArithmeticTask,
    CountdownTask,
    Task,
    make_task,
)
from rlax_tasks.rewards.tasks.countdown import parse_expression
from rlax_tasks.rewards.tasks.extract import final_integer


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_generation_is_deterministic_by_seed(name):
    task = make_task(name)
    assert isinstance(task, Task)
    a, b = task.generate(20, seed=7), task.generate(20, seed=7)
    assert a == b
    assert task.generate(5, seed=7) == a[:5]  # prefixes are stable
    assert task.generate(20, seed=8) != a
    assert len({p.id for p in a}) == 20


def test_arithmetic_answers_and_knobs():
    task = ArithmeticTask(min_digits=4, max_digits=4, num_operands=3)
    for problem in task.generate(30, seed=1):
        expr = problem.meta["expression"]
        assert problem.reference == str(eval(expr))  # noqa: S307 - our own digits and ops
        assert all(1000 <= v <= 9999 for v in problem.meta["operands"])
        assert len(problem.meta["operands"]) == 3
        assert task.score(problem, f"Thinking... so \\boxed{{{problem.reference}}}") == 1.0
        assert task.score(problem, f"The answer is {int(problem.reference) + 1}.") == 0.0
        assert task.score(problem, "no idea") == 0.0
    easy = ArithmeticTask.at_level(1).generate(10)
    assert all(v < 10 for p in easy for v in p.meta["operands"])
    with pytest.raises(ValueError, match="num_operands"):
        ArithmeticTask(num_operands=1)
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops=("**",))


def test_final_integer_extraction():
    assert final_integer(r"so \boxed{-1,234}") == -1234
    assert final_integer("first 3, then the answer is 17.") == 17
    assert final_integer("x = 5 and y = 9") == 9
    assert final_integer("nothing") is None


def test_countdown_reference_solution_verifies_and_knobs_apply():
    task = CountdownTask(num_numbers=5, max_number=10, max_target=500)
    for problem in task.generate(30, seed=3):
        numbers, target = problem.meta["numbers"], problem.meta["target"]
        assert len(numbers) == 5 and all(1 <= n <= 10 for n in numbers)
        assert 1 <= target <= 500 and str(target) in problem.prompt
        solution = problem.meta["solution"]
        assert task.score(problem, f"<answer>{solution}</answer>") == 1.0
        assert task.score(problem, f"<answer>{solution} = {target}</answer>") == 1.0


def test_countdown_rejects_illegal_answers():
    task = CountdownTask()
    problem = task.generate(1, seed=0)[0]
    nums = problem.meta["numbers"]
    target = problem.meta["target"]
    assert task.score(problem, f"<answer>{target}</answer>") == 0.0  # numbers not used
    reused = " + ".join(str(n) for n in nums + nums[:1])
    assert task.score(problem, f"<answer>{reused}</answer>") == 0.0
    for evil in (
        "__import__('os').system('true')",
        "9**9**9**9",
        "(1).__class__",
        "1/0",
        "1e3",
        "x",
        "1 +" * 200 + "1",
    ):
        assert task.score(problem, f"<answer>{evil}</answer>") == 0.0
    subset = CountdownTask(use_all=False)
    p2 = subset.generate(1, seed=0)[0]
    a, b = p2.meta["numbers"][:2]
    p2_partial = type(p2)(p2.task, p2.id, p2.prompt, str(a + b), p2.meta)
    assert subset.score(p2_partial, f"<answer>{a} + {b}</answer>") == 1.0


def test_parse_expression_is_exact():
    value, used = parse_expression("(6 / 4) * 2")
    assert value == 3 and used == [6, 4, 2]
    with pytest.raises(ValueError):
        parse_expression("2 ** 3")


def test_make_task_errors_name_the_problem():
    with pytest.raises(ValueError, match="'sudoku'"):
        make_task("sudoku")
    with pytest.raises(ValueError, match="max_digitz"):
        make_task("arithmetic", max_digitz=3)
    assert make_task("arithmetic", ops=["+"]).ops == ("+",)
