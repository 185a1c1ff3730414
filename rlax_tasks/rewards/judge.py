"""Judging programs against test cases in two rounds, as in the RLAX paper: round 1 runs every
(program, input) pair in the sandbox, round 2 checks every output (exact, whitespace tokens, or a
checker program); reward 1 only if all pass. Call-based submissions (``fn_name``, Python) import
the source as a module, call ``fn_name`` (else ``Solution().fn_name``) on stdin's JSON arguments
and compare the JSON result (floats within 1e-6; ``[x]`` expected also accepts ``x``, as APPS)."""

from __future__ import annotations

import json
import keyword
import logging
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from rlax_tasks.rewards.sandbox import ExecResult, Program, SandboxConfig, normalize_language

logger = logging.getLogger(__name__)

COMPARISONS = ("tokens", "exact")
# Per-test verdicts; "pass" is the only one that scores. Call-based: an exception or a missing
# function is "runtime_error", a wrong or missing return value "wrong_answer".
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
# Call-based judging: the driver runs the source as a module and prints the JSON return value on
# a last line after this marker, so that the program's own prints cannot be taken for the result.
_RESULT_MARKER = "@@rlax-call-result-6f1d2c@@ "
_FLOAT_TOLERANCE = 1e-6
_CALL_DRIVER = """
def _rlax_call_driver(source, fn_name, marker):
    import json, sys, types
    module = types.ModuleType("solution")  # imported, as APPS's harness does: no __main__ block
    module.__file__ = "solution.py"
    sys.modules["solution"] = module
    exec(compile(source, "solution.py", "exec"), module.__dict__)
    namespace = module.__dict__
    fn = namespace.get(fn_name)
    if not callable(fn):
        cls = namespace.get("Solution")
        fn = getattr(cls(), fn_name, None) if isinstance(cls, type) else None
    if not callable(fn):
        sys.stderr.write(f"no function {fn_name!r} and no method Solution.{fn_name}\\n")
        sys.exit(1)
    result = fn(*json.loads(sys.stdin.read()))
    try:
        text = json.dumps(result)
    except (TypeError, ValueError) as exc:
        sys.stderr.write(f"the return value is not JSON ({exc}): {repr(result)[:200]}\\n")
        sys.exit(1)
    sys.stdout.flush()
    sys.stdout.write("\\n" + marker + text + "\\n")
    sys.stdout.flush()


"""


@dataclass(frozen=True)
class TestCase:
    """One stdin input and the expected stdout (call-based: JSON arguments and return value)."""

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
    """A program to judge and its tests; with `fn_name`, a Python function judged call-based
    (`comparison` and `checker` then do not apply)."""

    source: str
    tests: tuple[TestCase, ...]
    language: str = "python"
    comparison: str = "tokens"
    checker: Checker | None = None
    timeout_s: float = 2.0
    memory_mb: int = 256
    fn_name: str | None = None


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


def validate_submission(sub: Submission) -> Submission:
    """The submission with its tests as `TestCase`s; ValueError says what is wrong (language,
    comparison, limits, tests, call-based fields), so callers can reject it before judging."""
    language = normalize_language(sub.language)
    if sub.comparison not in COMPARISONS:
        raise ValueError(
            f"unknown comparison {sub.comparison!r}; supported: {', '.join(COMPARISONS)}"
        )
    if sub.checker is not None:
        normalize_language(sub.checker.language)
    if not sub.tests:
        raise ValueError("a submission needs at least one test case")
    for name in ("timeout_s", "memory_mb"):
        value = getattr(sub, name)
        if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number, got {value!r}")
    tests = tuple(_as_test(t) for t in sub.tests)
    if sub.fn_name is not None:
        _validate_call_based(sub, language, tests)
    return Submission(
        sub.source,
        tests,
        sub.language,
        sub.comparison,
        sub.checker,
        sub.timeout_s,
        sub.memory_mb,
        sub.fn_name,
    )


def _validate_call_based(sub: Submission, language: str, tests: tuple[TestCase, ...]) -> None:
    name = sub.fn_name
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"fn_name must be a Python identifier, got {name!r}")
    if language != "python":
        raise ValueError(
            f"call-based judging (fn_name {name!r}) supports only Python, not {sub.language!r}"
        )
    if sub.checker is not None:
        raise ValueError(f"a call-based submission (fn_name {name!r}) cannot have a checker")
    for j, test in enumerate(tests):
        if not isinstance(_json_field(test.input, j, "input"), list):
            raise ValueError(f"test {j}: a call-based input is a JSON list of arguments")
        _json_field(test.expected, j, "expected")


def _json_field(text: str, index: int, name: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"test {index}: call-based {name} is not valid JSON ({exc.msg}): {text[:80]!r}"
        ) from exc


def _program_source(sub: Submission) -> str:
    """What runs in the sandbox: the source itself, or (call-based) the driver, which runs the
    source as a module named "solution" and calls its function."""
    if sub.fn_name is None:
        return sub.source
    call = f"_rlax_call_driver({sub.source!r}, {sub.fn_name!r}, {_RESULT_MARKER!r})\n"
    return _CALL_DRIVER + call


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
    subs = [validate_submission(s) for s in submissions]
    if not subs:
        return []
    parallel = max(1, max_parallel or os.cpu_count() or 1)
    programs: list[Program | None] = [None] * len(subs)
    checkers: dict[int, Program] = {}
    try:
        with ThreadPoolExecutor(parallel, thread_name_prefix="rlax-judge") as ex:
            # Round 0: build programs and checkers (compiles C++ once per program).
            futures = [
                ex.submit(Program, _program_source(s), s.language, config=config) for s in subs
            ]
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
    if sub.fn_name is not None:
        return _check_return_value(out.stdout, test.expected)
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


def _check_return_value(stdout: str, expected: str) -> tuple[str, str]:
    """Verdict of a call-based run from the value after the last result marker."""
    _, found, rest = stdout.rpartition(_RESULT_MARKER)
    if not found:
        return "wrong_answer", "no return value: the program ended before the function returned"
    text = rest.split("\n", 1)[0]
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return "wrong_answer", f"unreadable return value {text[:200]!r}"
    want = json.loads(expected)
    if _json_equal(value, want) or (
        isinstance(want, list) and len(want) == 1 and _json_equal(value, want[0])
    ):
        return "pass", ""
    return "wrong_answer", f"expected {expected[:200]}, got {text[:200]}"


def _json_equal(got: object, expected: object) -> bool:
    """Equality of parsed JSON values (a returned tuple arrives as a list): numbers within 1e-6
    (relative or absolute) unless both are ints, booleans never equal to numbers."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(got, int | float) and isinstance(expected, int | float):
        if isinstance(got, int) and isinstance(expected, int):
            return got == expected
        try:
            return math.isclose(got, expected, rel_tol=_FLOAT_TOLERANCE, abs_tol=_FLOAT_TOLERANCE)
        except OverflowError:
            return False
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(map(_json_equal, got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(_json_equal(got[k], expected[k]) for k in got)
    return type(got) is type(expected) and got == expected


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
    fn_name: str | None = None,
) -> JudgeResult:
    """Judge one program on its tests (see `judge_batch`; `fn_name`: call-based)."""
    sub = Submission(
        source,
        tuple(_as_test(t) for t in tests),
        language,
        comparison,
        checker,
        timeout_s,
        memory_mb,
        fn_name,
    )
    return judge_batch([sub], max_parallel, config=config)[0]
