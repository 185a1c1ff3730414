"""Verifier throughput: math checks/s of ``MathVerifier.check_batch`` on labelled RL-like groups
(agreement and cache hits printed), sandboxed code runs/s of ``judge_batch``, and one sandboxed
run's cost against a bare ``python -c pass`` and the bare program. Without bubblewrap only the
bare runs are measured; ``other_cores`` in the JSON counts the verifier's own workers too.
``.venv/bin/python benchmarks/verifiers.py [--math-rows 400 --code-programs 40]``"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _timing  # noqa: E402

log = logging.getLogger("benchmarks.verifiers")

CODE = "print(int(input()) + {k})\n"
FILLER = (
    "We set up the problem carefully. Expanding both sides and collecting like terms, the "
    "equation reduces to a simpler form; checking the boundary cases rules out the spurious "
    "solutions. "
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--math-rows", type=int, default=400, help="math pairs per timed pass")
    p.add_argument("--code-programs", type=int, default=40, help="programs per timed pass")
    p.add_argument("--tests", type=int, default=2, help="stdin tests per program (1-2 typical)")
    p.add_argument("--single-runs", type=int, default=30, help="runs for the overhead ratios")
    p.add_argument("--parallel", type=int, default=None, help="sandboxes at once (default: CPUs)")
    p.add_argument("--repeats", type=int, default=3, help="timed passes; median reported")
    p.add_argument("--cache-size", type=int, default=100_000, help="math cache (0: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-math", action="store_true", help="measure the code judge only")
    p.add_argument("--json-out", default=None, help="also write the results as JSON here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- math rows
def _problem(rng: random.Random) -> tuple[str, list[tuple[str, bool]]]:
    """A reference answer and answer forms: (LaTeX, is it equal to the reference)."""
    kind = rng.choice(("int", "frac", "sqrt", "pi", "poly", "tuple"))
    if kind == "int":
        n = rng.randint(2, 10**6)
        return str(n), [(str(n), True), (f"{n}.0", True), (str(n + rng.randint(1, 9)), False)]
    if kind == "frac":
        a, b = rng.randint(1, 99), rng.choice((2, 4, 5, 8, 16, 20, 25))
        g = math.gcd(a, b)
        a, b = a // g, b // g
        if b == 1:
            b, a = 2, 2 * a + 1
        return f"\\frac{{{a}}}{{{b}}}", [
            (f"\\frac{{{a}}}{{{b}}}", True),
            (f"{a / b:g}", True),  # b divides a power of 10: an exact decimal
            (f"\\frac{{{2 * a}}}{{{2 * b}}}", True),
            (f"\\frac{{{b}}}{{{a}}}", a == b),
        ]
    if kind == "sqrt":
        k, m = rng.randint(2, 9), rng.choice((2, 3, 5, 6, 7))
        return f"{k}\\sqrt{{{m}}}", [
            (f"{k}\\sqrt{{{m}}}", True),
            (f"\\sqrt{{{k * k * m}}}", True),
            (f"{k + 1}\\sqrt{{{m}}}", False),
        ]
    if kind == "pi":
        d = rng.choice((2, 3, 4, 6, 12))
        n = rng.randint(1, d - 1) if d > 2 else 1
        g = math.gcd(n, d)
        n, d = n // g, d // g
        return f"\\frac{{{n}\\pi}}{{{d}}}", [
            (f"\\frac{{{n}\\pi}}{{{d}}}", True),
            (f"\\frac{{{n}}}{{{d}}}\\pi", True),
            (f"\\frac{{{n + 1}\\pi}}{{{d}}}", False),
        ]
    if kind == "poly":
        a = rng.randint(1, 9)
        return f"x^2 + {2 * a}x + {a * a}", [
            (f"x^2 + {2 * a}x + {a * a}", True),
            (f"(x+{a})^2", True),
            (f"(x+{a + 1})^2", False),
        ]
    x, y = rng.randint(-20, 20), rng.randint(-20, 20)
    return f"({x}, {y})", [
        (f"({x}, {y})", True),
        (f"({x},{y})", True),
        (f"({y}, {x + 1})", False),
    ]


def math_rows(n: int, seed: int, group: int = 4) -> list[tuple[str, str, bool]]:
    """``n`` (completion, reference, expected verdict) rows: groups of ``group`` completions
    per problem, mixing right and wrong answers in several forms and shapes of completions."""
    rng = random.Random(seed)
    rows: list[tuple[str, str, bool]] = []
    while len(rows) < n:
        ref, forms = _problem(rng)
        for _ in range(group):
            answer, ok = rng.choice(forms)
            style = rng.random()
            if style < 0.55:  # short reasoning, boxed answer
                text = f"Solving step by step, we obtain $\\boxed{{{answer}}}$."
            elif style < 0.75:  # a long derivation before the box
                text = FILLER * rng.randint(3, 8) + f"Therefore the answer is \\boxed{{{answer}}}."
            elif style < 0.9:  # no box: the final answer in words
                text = f"After simplifying, the final answer is ${answer}$."
            else:  # no answer at all
                text, ok = "I could not finish this problem in time.", False
            rows.append((text, ref, ok))
    return rows[:n]


def bench_math(args: argparse.Namespace) -> dict[str, Any]:
    """Checks/s of a default MathVerifier on fresh rows each pass; agreement with labels."""
    from rlax_tasks.rewards.math import VERIFIER_VERSION, MathVerifier

    t0 = time.perf_counter()
    verifier = MathVerifier(cache_size=args.cache_size)
    # the first call of each worker waits until it has imported math-verify
    verifier.check_batch([(f"\\boxed{{{i}}}", str(i)) for i in range(verifier.workers)])
    spawn_s = time.perf_counter() - t0
    seeds = itertools.count(args.seed * 1000)
    verdicts: Counter[str] = Counter()
    agree = total = 0

    def one_pass() -> None:
        nonlocal agree, total
        rows = math_rows(args.math_rows, next(seeds))
        results = verifier.check_batch([(c, r) for c, r, _ in rows])
        for (_, _, ok), res in zip(rows, results, strict=True):
            verdicts[res.verdict] += 1
            agree += (res.reward == 1.0) == ok
            total += 1

    try:
        # a warm-up pass (sympy's and the parser's first uses), not counted
        _timing.median_time(one_pass, repeats=1, warmup=0, sync=_no_sync)
        verdicts.clear()
        agree = total = 0
        hits0 = verifier.cache_stats["hits"]
        timing = _timing.median_time(one_pass, repeats=args.repeats, warmup=0, sync=_no_sync)
        cache = verifier.cache_stats
        replaced = verifier.workers_replaced
        workers = verifier.workers
    finally:
        verifier.close()
    checks_per_s = args.math_rows / timing.median_s
    return {
        "verifier": VERIFIER_VERSION,
        "workers": workers,
        "rows_per_pass": args.math_rows,
        "checks_per_s": checks_per_s,
        "ms_per_check_per_worker": 1000 * workers / checks_per_s,
        "pool_start_s": spawn_s,
        "timing": timing.as_dict(),
        "verdicts": dict(verdicts),
        "label_agreement": agree / total if total else None,
        "cache_size": args.cache_size,
        "cache_hits_timed": cache["hits"] - hits0,
        "workers_replaced": replaced,
    }


# ---------------------------------------------------------------------- code and sandbox
def _no_sync(_: Any) -> None:
    """``median_time``'s sync for plain Python results (nothing runs asynchronously)."""


def sandbox_status() -> dict[str, Any]:
    """``sandbox_info()`` and a trial run, or why the sandbox cannot run here."""
    from rlax_tasks.rewards.sandbox import SandboxError, run, sandbox_info

    try:
        info = sandbox_info()
        trial = run(CODE.format(k=1), stdin="41\n")
    except (SandboxError, OSError) as exc:
        return {"available": False, "reason": str(exc)}
    if not trial.ok or trial.stdout.strip() != "42":
        return {"available": False, "reason": f"trial run gave {trial.status}: {trial.stderr}"}
    return {"available": True, **info}


def bench_code(args: argparse.Namespace) -> dict[str, Any]:
    """Sandbox runs/s of judge_batch on trivial programs, all of which must pass."""
    from rlax_tasks.rewards.judge import Submission, TestCase, judge_batch

    parallel = args.parallel or os.cpu_count() or 1
    rng = random.Random(args.seed)

    def submissions() -> list[Submission]:
        subs = []
        for _ in range(args.code_programs):
            k = rng.randint(1, 100)
            xs = [rng.randint(-(10**6), 10**6) for _ in range(args.tests)]
            tests = tuple(TestCase(f"{x}\n", f"{x + k}\n") for x in xs)
            subs.append(Submission(CODE.format(k=k), tests))
        return subs

    verdicts: Counter[str] = Counter()

    def one_pass() -> None:
        for res in judge_batch(submissions(), parallel):
            verdicts[res.verdict] += 1

    timing = _timing.median_time(one_pass, repeats=args.repeats, warmup=1, sync=_no_sync)
    runs = args.code_programs * args.tests
    return {
        "programs_per_pass": args.code_programs,
        "tests_per_program": args.tests,
        "parallel": parallel,
        "runs_per_s": runs / timing.median_s,
        "programs_per_s": args.code_programs / timing.median_s,
        "timing": timing.as_dict(),
        "verdicts": dict(verdicts),  # warm-up pass included; every one should be "pass"
    }


def _per_run(fn: Callable[[], Any], n: int) -> dict[str, Any]:
    """Median seconds of ``fn()`` called one at a time (``n`` timed after 2 warm-up calls)."""
    t = _timing.median_time(fn, repeats=n, warmup=2, sync=_no_sync)
    return {"median_s": t.median_s, "min_s": t.min_s, "max_s": t.max_s}


def bench_overhead(args: argparse.Namespace, sandbox: dict[str, Any]) -> dict[str, Any]:
    """One run at a time: sandboxed program vs bare interpreter starts, in this run."""
    out: dict[str, Any] = {
        "bare_python_pass": _per_run(
            lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), args.single_runs
        ),
        "bare_python": sys.executable,
    }
    if not sandbox["available"]:
        return out
    from rlax_tasks.rewards.sandbox import Program

    source = CODE.format(k=1)
    with tempfile.TemporaryDirectory(prefix="rlax-bench-bare-") as tmp:
        path = os.path.join(tmp, "main.py")
        with open(path, "w") as fh:
            fh.write(source)

        def bare_program() -> None:
            done = subprocess.run(
                [sandbox["python"], "-I", path], input="41\n", capture_output=True, text=True
            )
            assert done.stdout.strip() == "42", done

        out["bare_program"] = _per_run(bare_program, args.single_runs)
    with Program(source) as program:

        def sandboxed() -> None:
            res = program.run("41\n")
            assert res.ok and res.stdout.strip() == "42", res

        out["sandboxed_program"] = _per_run(sandboxed, args.single_runs)
    sbx = out["sandboxed_program"]["median_s"]
    out["ratio_vs_bare_python_pass"] = sbx / out["bare_python_pass"]["median_s"]
    out["ratio_vs_bare_program"] = sbx / out["bare_program"]["median_s"]
    out["overhead_s_vs_bare_program"] = sbx - out["bare_program"]["median_s"]
    return out


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _timing.setup_logging()
    before = _timing.machine_load(log)
    t_start = time.perf_counter()
    sandbox = sandbox_status()
    if sandbox["available"]:
        log.info("sandbox: %s", sandbox)
    else:
        log.warning("the sandbox cannot run here (%s): code runs are not measured", sandbox)
    results: dict[str, Any] = {"benchmark": "verifiers", "args": vars(args), "sandbox": sandbox}
    if not args.skip_math:
        log.info("math: %d rows per pass, %d passes", args.math_rows, args.repeats)
        results["math"] = bench_math(args)
    if sandbox["available"]:
        log.info("code: %d programs x %d tests per pass", args.code_programs, args.tests)
        results["code"] = bench_code(args)
    log.info("one run at a time: %d runs each", args.single_runs)
    results["overhead"] = bench_overhead(args, sandbox)
    after = _timing.machine_load(log, when="after")
    results["machine_load"] = {"before": before, "after": after}
    results["peak_rss_bytes"] = _timing.peak_rss_bytes()
    results["wall_s"] = time.perf_counter() - t_start
    print_report(results)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(results, fh, indent=2, default=str)
        log.info("wrote %s", args.json_out)
    return results


def print_report(r: dict[str, Any]) -> None:
    loads = r["machine_load"]
    mark = _timing.contended_mark(loads["before"], loads["after"])
    lines = [
        "",
        f"Verifier benchmark -- {os.cpu_count()} CPUs; before: "
        f"{_timing.describe_load(loads['before'])}; after: "
        f"{_timing.describe_load(loads['after'])}{mark}",
    ]
    m = r.get("math")
    if m:
        t = m["timing"]
        lines += [
            f"math ({m['verifier']}, {m['workers']} worker processes, pool start "
            f"{m['pool_start_s']:.1f} s): {m['rows_per_pass']} rows per pass, median of "
            f"{len(t['times_s'])}; verdicts {m['verdicts']}; agreement with the labels "
            f"{100 * m['label_agreement']:.1f}%; cache hits {m['cache_hits_timed']} of "
            f"{sum(m['verdicts'].values())} checks",
            f"  math checks: {m['checks_per_s']:,.1f} checks/s "
            f"({m['ms_per_check_per_worker']:.1f} ms per check per worker){mark}",
        ]
    sbx = r["sandbox"]
    if not sbx["available"]:
        lines.append(f"code: NOT MEASURED -- the sandbox cannot run here: {sbx['reason']}")
    c = r.get("code")
    if c:
        lines += [
            f"code ({sbx['version']}, {sbx['mode']}, sandbox python {sbx['python']}): "
            f"{c['programs_per_pass']} programs x {c['tests_per_program']} tests per pass, "
            f"{c['parallel']} sandboxes at once; verdicts {c['verdicts']}",
            f"  code runs: {c['runs_per_s']:,.1f} sandboxed runs/s "
            f"({c['programs_per_s']:,.1f} programs/s){mark}",
        ]
    o = r["overhead"]
    lines.append(
        f"one at a time: bare `{os.path.basename(o['bare_python'])} -c pass` "
        f"{1000 * o['bare_python_pass']['median_s']:.1f} ms{mark}"
    )
    if "sandboxed_program" in o:
        lines += [
            f"  bare program (sandbox's interpreter, no sandbox) "
            f"{1000 * o['bare_program']['median_s']:.1f} ms; sandboxed program "
            f"{1000 * o['sandboxed_program']['median_s']:.1f} ms per run{mark}",
            f"  ratio sandboxed run / bare `python -c pass` = "
            f"{o['ratio_vs_bare_python_pass']:.2f}x{mark}",
            f"  ratio sandboxed run / same program bare = {o['ratio_vs_bare_program']:.2f}x "
            f"(+{1000 * o['overhead_s_vs_bare_program']:.1f} ms per run){mark}",
        ]
    lines += [f"peak RSS: {r['peak_rss_bytes'] / 2**20:,.0f} MiB; wall {r['wall_s']:.0f} s", ""]
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
