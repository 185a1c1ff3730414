"""Rewards for completions: math answers with `rlax_tasks.rewards.math`, programs with
`rlax_tasks.rewards.judge` against the row's tests."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_CODE_BLOCK_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class SampleScore:
    """Reward of one completion; `answer` is the extracted final answer (math; None when
    absent or for code), the vote in maj@k; `verdict` comes from the verifier."""

    reward: float
    verdict: str
    answer: str | None = None


def extract_code(completion: str) -> str:
    """The last fenced code block of a completion, or the whole completion without one."""
    blocks = _CODE_BLOCK_RE.findall(completion)
    return blocks[-1][1] if blocks else completion


def score_completions(
    answers: Sequence[str | None],
    tests: Sequence[list[dict] | None],
    completions: Sequence[Sequence[str]],
    *,
    language: str = "python",
    timeout_s: float = 2.0,
    memory_mb: int = 256,
) -> list[list[SampleScore]]:
    """Scores of every completion of every row: rows with an answer are checked by the math
    verifier, rows with only tests are judged by running the extracted program."""
    if not len(answers) == len(tests) == len(completions):
        raise ValueError(
            f"answers, tests and completions differ in length: {len(answers)}, {len(tests)}, "
            f"{len(completions)}"
        )
    out: list[list[SampleScore | None]] = [[None] * len(c) for c in completions]
    math_pairs, math_where = [], []
    code_subs, code_where = [], []
    for r, (answer, row_tests, comps) in enumerate(zip(answers, tests, completions, strict=True)):
        for s, completion in enumerate(comps):
            if answer is not None:
                math_pairs.append((completion, answer))
                math_where.append((r, s))
            elif row_tests:
                code_subs.append((extract_code(completion), row_tests))
                code_where.append((r, s))
            else:
                raise ValueError(f"row {r}: no answer and no tests to score against")
    if math_pairs:
        from rlax_tasks.rewards.math import check_batch

        for (r, s), res in zip(math_where, check_batch(math_pairs), strict=True):
            out[r][s] = SampleScore(res.reward, res.verdict, res.extracted)
    if code_subs:
        from rlax_tasks.rewards.judge import Submission, TestCase, judge_batch

        subs = [
            Submission(
                source,
                tuple(TestCase(t["input"], t["output"]) for t in row_tests),
                language,
                timeout_s=timeout_s,
                memory_mb=memory_mb,
            )
            for source, row_tests in code_subs
        ]
        for (r, s), res in zip(code_where, judge_batch(subs), strict=True):
            out[r][s] = SampleScore(res.reward, res.verdict, None)
    return [[x for x in row if x is not None] for row in out]
