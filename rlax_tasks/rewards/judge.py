"""Judging programs against test cases in two rounds, as in the RLAX paper.

Round 1 runs every (program, input) pair in the sandbox; round 2 checks every output, by exact
or whitespace-token comparison or with a checker program. Reward is 1 only if all tests pass.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from rlax_tasks.rewards.sandbox import ExecResult, Program, SandboxConfig, normalize_language

logger = logging.getLogger(__name__)

COMPARISONS = ("tokens", "exact")
# Per-test verdicts; "pass" is the only one that scores.
VERDICTS = (
    "pass",
    "wrong_answer",
    "timeout",
    "memory",
    "runtime_error",
    "compile_error",
    "output_limit",
    "checker_error",
)


@dataclass(frozen=True)
class TestCase:
    """One stdin input and the expected stdout."""

    __test__ = False  # not a pytest test class

    input: str
    expected: str


@dataclass(frozen=True)
class Checker:
    """A checker program: run as `checker input.txt expected.txt output.txt` (files are also
    under /sandbox/); exit code 0 = accepted, 1 or 2 = wrong answer, anything else = broken."""

    source: str
    language: str = "python"
    timeout_s: float = 5.0
    memory_mb: int = 512


@dataclass(frozen=True)
class Submission:
    """A program to judge and its tests."""

    source: str
    tests: tuple[TestCase, ...]
    language: str = "python"
    comparison: str = "tokens"
    checker: Checker | None = None
    timeout_s: float = 2.0
    memory_mb: int = 256


@dataclass
class TestVerdict:
    """Verdict of one test; `status` is the sandbox status of the program run."""

    __test__ = False

    index: int
    verdict: str
    status: str
    wall_s: float
    detail: str = ""


@dataclass
class JudgeResult:
    """Reward (1.0 only if every test passes), overall verdict and per-test verdicts."""

    reward: float
    verdict: str
    tests: list[TestVerdict] = field(default_factory=list)
    compile_output: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _as_test(test: TestCase | tuple | dict) -> TestCase:
    if isinstance(test, TestCase):
        return test
    if isinstance(test, dict):
        return TestCase(str(test["input"]), str(test["expected"]))
    inp, expected = test
    return TestCase(str(inp), str(expected))


def outputs_match(output: str, expected: str, comparison: str = "tokens") -> bool:
    """Compare a program's stdout with the expected answer."""
    if comparison == "tokens":
        return output.split() == expected.split()
    if comparison == "exact":
        return output == expected
    raise ValueError(f"unknown comparison {comparison!r}; supported: {', '.join(COMPARISONS)}")


def _validate(sub: Submission) -> Submission:
    normalize_language(sub.language)
    if sub.comparison not in COMPARISONS:
        raise ValueError(
            f"unknown comparison {sub.comparison!r}; supported: {', '.join(COMPARISONS)}"
        )
    if sub.checker is not None:
        normalize_language(sub.checker.language)
    if not sub.tests:
        raise ValueError("a submission needs at least one test case")
    return Submission(
        sub.source,
        tuple(_as_test(t) for t in sub.tests),
        sub.language,
        sub.comparison,
        sub.checker,
        sub.timeout_s,
        sub.memory_mb,
    )


def _run_verdict(result: ExecResult) -> str:
    return "runtime_error" if result.status == "ok" else result.status


def judge_batch(
    submissions: Sequence[Submission],
    max_parallel: int | None = None,
    *,
    config: SandboxConfig | None = None,
) -> list[JudgeResult]:
    """Judge many submissions: compile all, run all (program, input) pairs, then check all
    outputs; at most `max_parallel` sandboxes at a time (default: CPU count)."""
    subs = [_validate(s) for s in submissions]
    if not subs:
        return []
    parallel = max(1, max_parallel or os.cpu_count() or 1)
    programs: list[Program | None] = [None] * len(subs)
    checkers: dict[int, Program] = {}
    try:
        with ThreadPoolExecutor(parallel, thread_name_prefix="rlax-judge") as ex:
            # Round 0: build programs and checkers (compiles C++ once per program).
            futures = [ex.submit(Program, s.source, s.language, config=config) for s in subs]
            errors = []
            for i, fut in enumerate(futures):
                try:
                    programs[i] = fut.result()
                except Exception as exc:  # noqa: BLE001 - re-raised below after cleanup
                    errors.append(exc)
            if errors:
                raise errors[0]
            built: list[Program] = [p for p in programs if p is not None]
            for i, s in enumerate(subs):
                if s.checker is not None:
                    checkers[i] = Program(s.checker.source, s.checker.language, config=config)
            # Round 1: every (program, input) pair.
            pairs = [(i, j) for i, s in enumerate(subs) for j in range(len(s.tests))]

            def run_pair(pair: tuple[int, int]) -> ExecResult:
                i, j = pair
                s = subs[i]
                return built[i].run(s.tests[j].input, s.timeout_s, s.memory_mb)

            outputs = dict(zip(pairs, ex.map(run_pair, pairs), strict=True))
            # Round 2: check every output that ran to completion.
            to_check = [p for p in pairs if outputs[p].status == "ok"]
            checked = dict(
                zip(
                    to_check,
                    ex.map(
                        lambda p: _check_output(subs[p[0]], p[1], outputs[p], checkers.get(p[0])),
                        to_check,
                    ),
                    strict=True,
                )
            )
    finally:
        for program in [*programs, *checkers.values()]:
            if program is not None:
                program.close()

    results = []
    for i, s in enumerate(subs):
        program = programs[i]
        compile_output = ""
        if program is not None and program.compile_result is not None:
            compile_output = program.compile_result.stderr
        tests = []
        for j in range(len(s.tests)):
            out = outputs[(i, j)]
            verdict, detail = checked.get((i, j), (_run_verdict(out), out.stderr[-500:]))
            tests.append(TestVerdict(j, verdict, out.status, out.wall_s, detail))
        failed = [t.verdict for t in tests if t.verdict != "pass"]
        results.append(
            JudgeResult(
                0.0 if failed else 1.0, failed[0] if failed else "pass", tests, compile_output
            )
        )
    return results


def _check_output(
    sub: Submission, index: int, out: ExecResult, checker: Program | None
) -> tuple[str, str]:
    test = sub.tests[index]
    if checker is None:
        ok = outputs_match(out.stdout, test.expected, sub.comparison)
        return ("pass" if ok else "wrong_answer"), ""
    files = {"input.txt": test.input, "expected.txt": test.expected, "output.txt": out.stdout}
    res = checker.run(
        "",
        sub.checker.timeout_s,
        sub.checker.memory_mb,
        args=("/sandbox/input.txt", "/sandbox/expected.txt", "/sandbox/output.txt"),
        files=files,
    )
    if res.status == "ok":
        return "pass", res.stdout[-500:]
    if res.status == "runtime_error" and res.exit_code in (1, 2):
        return "wrong_answer", (res.stdout + res.stderr)[-500:]
    logger.warning(
        "checker failed on test %d: status=%s exit=%s %s",
        index,
        res.status,
        res.exit_code,
        res.stderr[-300:],
    )
    return "checker_error", f"checker {res.status} (exit {res.exit_code}): {res.stderr[-400:]}"


def judge(
    source: str,
    tests: Sequence[TestCase | tuple[str, str]],
    language: str = "python",
    *,
    comparison: str = "tokens",
    checker: Checker | None = None,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    max_parallel: int | None = None,
    config: SandboxConfig | None = None,
) -> JudgeResult:
    """Judge one program on its tests (see `judge_batch`)."""
    sub = Submission(
        source,
        tuple(_as_test(t) for t in tests),
        language,
        comparison,
        checker,
        timeout_s,
        memory_mb,
    )
    return judge_batch([sub], max_parallel, config=config)[0]
