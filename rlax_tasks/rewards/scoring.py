"""Rewards for completions: math answers with `rlax_tasks.rewards.math`, programs with
`rlax_tasks.rewards.judge` against the row's test suite (`rlax_tasks.data.code_tests`)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlax_tasks.data.code_tests import CodeTests
from rlax_tasks.rewards import math as math_verifier
from rlax_tasks.rewards.judge import (
    JudgeResult,
    Submission,
    TestCase,
    judge_batch,
    validate_submission,
)

# Verdict of a completion that could not be judged because its row is broken (tests that do
# not parse, a submission the judge rejects); it scores 0 and `detail` says why.
VERIFIER_ERROR = "verifier_error"
_DETAIL_CHARS = 500
_CODE_BLOCK_RE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)


@dataclass(frozen=True)
class SampleScore:
    """Reward of one completion; `answer` is the extracted final answer (math; None when
    absent or for code), the vote in maj@k; `verdict` and `detail` come from the verifier."""

    reward: float
    verdict: str
    answer: str | None = None
    detail: str = ""


def extract_code(completion: str) -> str:
    """The last fenced code block of a completion, or the whole completion without one."""
    blocks = _CODE_BLOCK_RE.findall(completion)
    return blocks[-1][1] if blocks else completion


def score_completions(
    answers: Sequence[str | None],
    tests: Sequence[Any],
    completions: Sequence[Sequence[str]],
    *,
    language: str = "python",
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    max_parallel: int | None = None,
) -> list[list[SampleScore]]:
    """Scores of every completion of every row: rows with an answer go to the math verifier,
    rows with tests (anything `CodeTests.from_value` reads) to one batched judge call, under
    the suite's own limits when it has them; a broken row scores "verifier_error"."""
    if not len(answers) == len(tests) == len(completions):
        raise ValueError(
            f"answers, tests and completions differ in length: {len(answers)}, {len(tests)}, "
            f"{len(completions)}"
        )
    out: list[list[SampleScore | None]] = [[None] * len(c) for c in completions]
    math_pairs, math_where = [], []
    code_subs, code_where = [], []
    for r, (answer, row_tests, comps) in enumerate(zip(answers, tests, completions, strict=True)):
        if answer is not None:
            math_pairs += [(completion, answer) for completion in comps]
            math_where += [(r, s) for s in range(len(comps))]
            continue
        if row_tests is None:
            raise ValueError(f"row {r}: no answer and no tests to score against")
        try:
            suite = CodeTests.from_value(row_tests)
        except (ValueError, TypeError) as exc:  # FieldError is a ValueError
            out[r] = [_verifier_error(f"tests: {exc}")] * len(comps)
            continue
        for s, completion in enumerate(comps):
            sub = _submission(extract_code(completion), suite, language, timeout_s, memory_mb)
            try:
                code_subs.append(validate_submission(sub))
            except ValueError as exc:
                out[r][s] = _verifier_error(f"submission: {exc}")
                continue
            code_where.append((r, s))
    if math_pairs:
        math_results = math_verifier.check_batch(math_pairs, max_parallel)
        for (r, s), res in zip(math_where, math_results, strict=True):
            out[r][s] = SampleScore(res.reward, res.verdict, res.extracted)
    if code_subs:
        results = judge_batch(code_subs, max_parallel)
        for (r, s), res in zip(code_where, results, strict=True):
            out[r][s] = SampleScore(res.reward, res.verdict, None, _failure_detail(res))
    return [[x for x in row if x is not None] for row in out]


def _submission(
    source: str, suite: CodeTests, language: str, timeout_s: float, memory_mb: int
) -> Submission:
    """The judge's submission of one program: the suite's cases, and its limits over ours."""
    return Submission(
        source,
        tuple(TestCase(c.input, c.output) for c in suite.cases),
        language,
        timeout_s=suite.time_limit_s or timeout_s,
        memory_mb=suite.memory_mb or memory_mb,
        fn_name=suite.fn_name,
    )


def _verifier_error(reason: str) -> SampleScore:
    return SampleScore(0.0, VERIFIER_ERROR, None, reason[:_DETAIL_CHARS])


def _failure_detail(result: JudgeResult) -> str:
    """Why a program failed: its first failing test (or the compiler's output); "" on a pass."""
    failed = next((t for t in result.tests if t.verdict != "pass"), None)
    if failed is None:
        return ""
    if failed.verdict == "compile_error" and result.compile_output:
        return f"compile error: {result.compile_output[-_DETAIL_CHARS:]}"
    detail = failed.detail.strip()[-_DETAIL_CHARS:]
    return f"test {failed.index}: {failed.verdict}" + (f": {detail}" if detail else "")
