"""Small dataset files in the layouts the public sets ship, with the canonical rows a reader owes.

Each ``write_<layout>(directory)`` writes one file and returns a ``LayoutFixture``: its path, the
built-in format that reads it (docs/design.md §11) and, in file order, one expected row per raw
row::

    {"prompt": str | [{"role", "content"}, ...], "answer": str | None,
     "tests": CodeTests(...).to_dict() | None, "bad": None | "<raw column at fault>"}

A row with ``bad`` set must be quarantined with an error naming that column; its other keys are
None. The layouts mirror (column names and types from the public dataset cards / loaders):

- ``write_gsm8k``: openai/gsm8k (JSONL {question, answer}); the reference is the number after
  ``####`` without thousands separators (the GSM8K paper's answer extraction).
- ``write_math``: hendrycks MATH (JSONL {problem, level "Level N", type, solution}) and one
  HuggingFaceH4/MATH-500 row (adds answer, subject, unique_id, integer level); the reference is
  the last ``\\boxed{...}`` of the solution, nested braces kept (the MATH paper's convention).
- ``write_dapo``: BytedTsinghua-SIA/DAPO-Math-17k (Parquet: prompt list<struct<content, role>>,
  reward_model struct<ground_truth, style>, extra_info struct<index>); verl's RL layout.
- ``write_messages``: the OpenAI-style {messages, answer} chat layout.
- ``write_code_apps``: codeparrot/apps (JSONL, ``solutions`` / ``input_output`` JSON strings,
  ``fn_name`` for call-based problems) and one BAAI/TACO row (``time_limit`` "2 seconds",
  ``memory_limit`` "128 megabytes"). APPS/TACO have no public/private split: all cases public.
- ``write_code_livecodebench``: livecodebench/code_generation_lite (``public_test_cases`` /
  ``private_test_cases`` JSON strings of {input, output, testtype}; functional inputs are one
  JSON value per line, ``metadata`` JSON holds ``func_name``). Private tests are plain JSON here;
  the public release compresses most of them (base64 of zlib of pickle), left out on purpose.
- ``write_code_contests``: deepmind/code_contests (Parquet: public/private/generated_tests as
  struct<input: list, output: list>, ``source`` an int enum, ``time_limit`` struct<seconds,
  nanos>, ``memory_limit_bytes``); cases in the order public, private, generated.

Code rows: the prompt is the problem text, plus ``"\\n\\n```python\\n" + starter_code.rstrip() +
"\\n```"`` when there is starter code; call-based inputs are ``json.dumps`` of the argument list.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rlax_tasks.data.code_tests import CodeCase, CodeTests

Pair = tuple[dict[str, Any], dict[str, Any]]  # (raw row as written, expected canonical row)


@dataclasses.dataclass(frozen=True)
class LayoutFixture:
    """A written dataset file, the format that reads it and the rows it must give, in order."""

    path: str
    format: str
    rows: list[dict[str, Any]]


# ------------------------------------------------------------------------------ helpers
def _ok(prompt: Any, answer: str | None = None, tests: dict | None = None) -> dict[str, Any]:
    return {"prompt": prompt, "answer": answer, "tests": tests, "bad": None}


def _bad(column: str) -> dict[str, Any]:
    return {"prompt": None, "answer": None, "tests": None, "bad": column}


def _suite(cases: list[tuple[str, str, bool]], fn_name: str | None = None,
           time_limit_s: float | None = None, memory_mb: int | None = None) -> dict[str, Any]:
    suite = CodeTests(tuple(CodeCase(*c) for c in cases), fn_name, time_limit_s, memory_mb)
    return suite.to_dict()


def _code_prompt(question: str, starter_code: str = "") -> str:
    if not starter_code.strip():
        return question
    return f"{question}\n\n```python\n{starter_code.rstrip()}\n```"


def _jsonl(directory: str, name: str, fmt: str, pairs: list[Pair]) -> LayoutFixture:
    path = os.path.join(directory, name)
    with open(path, "w", encoding="utf-8") as f:
        for raw, _ in pairs:
            f.write(json.dumps(raw, ensure_ascii=False) + "\n")
    return LayoutFixture(path, fmt, [expected for _, expected in pairs])


def _parquet(directory: str, name: str, fmt: str, schema: pa.Schema,
             pairs: list[Pair]) -> LayoutFixture:
    path = os.path.join(directory, name)
    pq.write_table(pa.Table.from_pylist([raw for raw, _ in pairs], schema=schema), path)
    return LayoutFixture(path, fmt, [expected for _, expected in pairs])


# -------------------------------------------------------------------------------- math
NATALIA = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?"
)


def write_gsm8k(directory: str) -> LayoutFixture:
    """GSM8K: calculator annotations, ``#### N`` with commas, negatives, decimals; bad rows."""
    library = "A library buys 40 boxes of 25 books each. How many books does it buy?"
    cold = "It was 7 degrees at noon and 12 degrees colder at midnight. How warm was it then?"
    pie = "Zoë ate 1/4 of a pie. What part of the pie is left, as a decimal?"
    tickets = "A stadium sold 1,234,000 tickets last season and 567 more this season. Total?"
    pairs: list[Pair] = [
        ({"question": NATALIA, "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
          "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
         _ok(NATALIA, "72")),
        ({"question": f"  {library}\n", "answer":
          "It buys 40*25 = <<40*25=1000>>1000 books.\n#### 1,000"}, _ok(library, "1000")),
        ({"question": cold, "answer": "It was 7-12 = <<7-12=-5>>-5 degrees.\n#### -5"},
         _ok(cold, "-5")),
        ({"question": pie, "answer": "Zoë left 1-0.25 = <<1-0.25=0.75>>0.75 of it.\n#### 0.75"},
         _ok(pie, "0.75")),
        ({"question": tickets, "answer": "It sold 1234000+567 = <<1234000+567=1234567>>"
          "1,234,567 tickets.\n#### 1,234,567"}, _ok(tickets, "1234567")),
        ({"question": "Tom has 3 apples and buys 2 more. How many apples does he have?",
          "answer": "Tom has 3+2 = <<3+2=5>>5 apples.\nThe answer is 5."}, _bad("answer")),
        ({"question": "  \n\t", "answer": "She has 1+2 = <<1+2=3>>3 pens.\n#### 3"},
         _bad("question")),
    ]
    return _jsonl(directory, "gsm8k_test.jsonl", "gsm8k", pairs)


def _math(problem: str, solution: str, level: str = "Level 3", kind: str = "Algebra") -> dict:
    return {"problem": problem, "level": level, "type": kind, "solution": solution}


def write_math(directory: str) -> LayoutFixture:
    """MATH: last ``\\boxed{}`` with nested braces, two boxed values, a tuple, ``\\text{}``,
    no boxed value (bad), and a MATH-500 row with its own answer column."""
    half = "What is $\\frac{3}{6}$ in lowest terms?"
    sine = "Compute $\\sin 60^\\circ$."
    roots = "Solve $x^2 - 7x + 10 = 0$ and give the larger root."
    point = "Find the point where $y = x + 1$ meets $y = 3x - 1$."
    choice = "Which number is prime? (A) 4 (B) 6 (C) 7"
    frac = "If $f(x) = \\frac{x+1}{x+2}$, what is $f(1) + f(2)$? Express it as a common fraction."
    pairs: list[Pair] = [
        (_math(half, "Divide both by 3: $\\frac{3}{6} = \\boxed{\\frac{1}{2}}$.", "Level 1",
               "Prealgebra"), _ok(half, "\\frac{1}{2}")),
        (_math(sine, "On the unit circle, $\\sin 60^\\circ = \\boxed{\\dfrac{\\sqrt{3}}{2}}$.",
               "Level 2", "Precalculus"), _ok(sine, "\\dfrac{\\sqrt{3}}{2}")),
        (_math(roots, "Factoring, $(x-2)(x-5) = 0$, so the roots are $\\boxed{2}$ and $5$. "
               "The larger root is $\\boxed{5}$."), _ok(roots, "5")),
        (_math(point, "From $x + 1 = 3x - 1$, $x = 1$ and $y = 2$: the point is "
               "$\\boxed{(1,2)}$."), _ok(point, "(1,2)")),
        (_math(choice, "Only 7 is prime, so the answer is $\\boxed{\\text{(C)}}$.", "Level 1",
               "Number Theory"), _ok(choice, "\\text{(C)}")),
        (_math("What is $2 + 2$?", "Adding, we get $2 + 2 = 4$."), _bad("solution")),
        ({"problem": frac, "solution": "$f(1) = \\frac{2}{3}$ and $f(2) = \\frac{3}{4}$, so the "
          "sum is $\\frac{8}{12} + \\frac{9}{12} = \\boxed{\\frac{17}{12}}$.",
          "answer": "\\frac{17}{12}", "subject": "Algebra", "level": 2,
          "unique_id": "test/algebra/1024.json"}, _ok(frac, "\\frac{17}{12}")),
    ]
    return _jsonl(directory, "math.jsonl", "math", pairs)


DAPO_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
    ("extra_info", pa.struct([("index", pa.string())])),
])
DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}"
    "\n\nRemember to put your answer on its own line after \"Answer:\"."
)


def _dapo(messages: list[dict[str, str]], truth: str, index: str) -> Pair:
    raw = {
        "data_source": "math_dapo",
        "prompt": [{"content": m["content"], "role": m["role"]} for m in messages],
        "ability": "MATH",
        "reward_model": {"ground_truth": truth, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }
    return raw, (_ok(messages, truth) if truth else _bad("reward_model"))


def write_dapo(directory: str) -> LayoutFixture:
    """DAPO-Math-17k: a user-only prompt, a system + user prompt, an empty ground truth (bad)."""
    def user(problem: str) -> dict[str, str]:
        return {"role": "user", "content": DAPO_INSTRUCTION.format(problem)}

    system = {"role": "system", "content": "You are a careful mathematician."}
    pairs = [
        _dapo([user("Two numbers sum to 50 and differ by 18. What is the larger one?")], "34",
              "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"),
        _dapo([system, user("How many positive divisors does 60 have?")], "12",
              "b426d104-244d-4831-a2c4-cd756b61700a"),
        _dapo([user("What is $3^4 - 1$?")], "", "2d1f3c9e-7c8a-4b8e-9f61-0a5c1e2d3b4f"),
    ]
    return _parquet(directory, "dapo_math_17k.parquet", "dapo", DAPO_SCHEMA, pairs)


def write_messages(directory: str) -> LayoutFixture:
    """Chat messages: system + user, multi-turn ending on user; last turn from the assistant and
    a message without content (both bad)."""
    system_user = [{"role": "system", "content": "You are a helpful assistant."},
                   {"role": "user", "content": "What is 2 + 2?"}]
    multi_turn = [{"role": "user", "content": "What is 3 * 3?"},
                  {"role": "assistant", "content": "9"},
                  {"role": "user", "content": "And 9 * 9?"}]
    pairs: list[Pair] = [
        ({"messages": system_user, "answer": "4"}, _ok(system_user, "4")),
        ({"messages": multi_turn, "answer": "81"}, _ok(multi_turn, "81")),
        ({"messages": [*system_user, {"role": "assistant", "content": "4"}], "answer": "4"},
         _bad("messages")),
        ({"messages": [{"role": "user"}], "answer": "1"}, _bad("messages")),
    ]
    return _jsonl(directory, "messages.jsonl", "messages", pairs)


# -------------------------------------------------------------------------------- code
SUM_QUESTION = (
    "You are given two integers $a$ and $b$. Print $a + b$.\n\n-----Input-----\n\nThe only line "
    "contains $a$ and $b$ ($-10^9 \\le a, b \\le 10^9$).\n\n-----Output-----\n\nPrint $a + b$."
)
SUM_SOLUTION = "a, b = map(int, input().split())\nprint(a + b)\n"
ADD_SOLUTION = "def add(a, b):\n    return a + b\n"
ARRAY_SOLUTION = "input()\nprint(sum(map(int, input().split())))\n"
MAX_SOLUTION = "input()\nprint(max(map(int, input().split())))\n"


def _apps(problem_id: int, question: str, input_output: str, starter_code: str = "",
          url: str = "https://codeforces.com/problemset/problem/1/A",
          solution: str = SUM_SOLUTION) -> dict[str, Any]:
    return {"problem_id": problem_id, "question": question,
            "solutions": json.dumps([solution]), "input_output": input_output,
            "difficulty": "interview", "url": url, "starter_code": starter_code}


def _taco(question: str, input_output: str, time_limit: str, memory_limit: str) -> dict:
    return {
        "question": question, "solutions": json.dumps([ARRAY_SOLUTION]), "starter_code": "",
        "input_output": input_output, "difficulty": "EASY", "raw_tags": "['implementation']",
        "name": "Sum of Array", "source": "codeforces", "tags": "['Implementation']",
        "skill_types": "[]", "url": "https://codeforces.com/problemset/problem/2/A",
        "Expected Auxiliary Space": None, "time_limit": time_limit, "date": "2021-01-01",
        "picture_num": "0", "memory_limit": memory_limit, "Expected Time Complexity": None,
    }


def write_code_apps(directory: str) -> LayoutFixture:
    """APPS/TACO: stdin/stdout, call-based with starter code, TACO limits, broken JSON (bad)."""
    add_question = "Write a function `add` that returns the sum of its two arguments."
    add_starter = "def add(a, b):\n\t"
    array_question = "Given $n$ and then $n$ integers, print their sum."
    stdin_io = {"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]}
    call_io = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]}
    taco_io = {"inputs": ["3\n1 2 3\n"], "outputs": ["6\n"]}
    pairs: list[Pair] = [
        (_apps(4001, SUM_QUESTION, json.dumps(stdin_io)),
         _ok(SUM_QUESTION, tests=_suite([("1 2\n", "3\n", True), ("10 -3\n", "7\n", True)]))),
        (_apps(4002, add_question, json.dumps(call_io), add_starter,
               "https://www.codewars.com/kata/add", ADD_SOLUTION),
         _ok(_code_prompt(add_question, add_starter),
             tests=_suite([("[1, 2]", "[3]", True), ("[3, 4]", "[7]", True)], "add"))),
        (_taco(array_question, json.dumps(taco_io), "2 seconds", "128 megabytes"),
         _ok(array_question, tests=_suite([("3\n1 2 3\n", "6\n", True)], None, 2.0, 128))),
        (_apps(4003, SUM_QUESTION, '{"inputs": ["1 2\\n"], "outputs": ["3\\n"'),
         _bad("input_output")),
    ]
    return _jsonl(directory, "apps.jsonl", "code", pairs)


def _lcb_cases(cases: list[tuple[str, str]], testtype: str) -> str:
    return json.dumps([{"input": i, "output": o, "testtype": testtype} for i, o in cases])


def _lcb(question_id: str, content: str, public: str, private: str, starter_code: str = "",
         metadata: str = "{}", platform: str = "atcoder") -> dict[str, Any]:
    return {
        "question_title": f"Problem {question_id}", "question_content": content,
        "platform": platform, "question_id": question_id, "contest_id": question_id[:6],
        "contest_date": "2024-03-02T00:00:00", "starter_code": starter_code,
        "difficulty": "easy", "public_test_cases": public, "private_test_cases": private,
        "metadata": metadata,
    }


def write_code_livecodebench(directory: str) -> LayoutFixture:
    """LiveCodeBench: stdin problem (public + private cases), functional LeetCode problem
    (newline-separated JSON args, func_name in metadata), a case without output (bad)."""
    stdin_q = "Print the sum of the $N$ integers given on the second line."
    func_q = "Return the largest sum of $k$ elements of `nums`."
    starter = "class Solution:\n    def maxSum(self, nums: List[int], k: int) -> int:\n        "
    public_stdin = [("3\n1 2 3\n", "6\n")]
    private_stdin = [("1\n5\n", "5\n"), ("2\n-1 1\n", "0\n")]
    no_output = json.dumps([{"input": "1\n7\n", "testtype": "stdin"}])
    pairs: list[Pair] = [
        (_lcb("abc340_a", stdin_q, _lcb_cases(public_stdin, "stdin"),
              _lcb_cases(private_stdin, "stdin")),
         _ok(stdin_q, tests=_suite([("3\n1 2 3\n", "6\n", True), ("1\n5\n", "5\n", False),
                                    ("2\n-1 1\n", "0\n", False)]))),
        (_lcb("3000", func_q, _lcb_cases([("[1, 2, 3]\n2", "5")], "functional"),
              _lcb_cases([('[4, 4, 1]\n1', "4")], "functional"), starter,
              '{"func_name": "maxSum"}', "leetcode"),
         _ok(_code_prompt(func_q, starter), tests=_suite(
             [("[[1, 2, 3], 2]", "5", True), ("[[4, 4, 1], 1]", "4", False)], "maxSum"))),
        (_lcb("abc340_b", stdin_q, _lcb_cases(public_stdin, "stdin"), no_output),
         _bad("private_test_cases")),
    ]
    return _jsonl(directory, "livecodebench.jsonl", "code", pairs)


_TESTS = pa.struct([("input", pa.list_(pa.string())), ("output", pa.list_(pa.string()))])
_SOLUTIONS = pa.struct([("language", pa.list_(pa.int64())), ("solution", pa.list_(pa.string()))])
CODE_CONTESTS_SCHEMA = pa.schema([
    ("name", pa.string()), ("description", pa.string()), ("public_tests", _TESTS),
    ("private_tests", _TESTS), ("generated_tests", _TESTS), ("source", pa.int64()),
    ("difficulty", pa.int64()), ("solutions", _SOLUTIONS), ("incorrect_solutions", _SOLUTIONS),
    ("cf_contest_id", pa.int64()), ("cf_index", pa.string()), ("cf_points", pa.float64()),
    ("cf_rating", pa.int64()), ("cf_tags", pa.list_(pa.string())),
    ("is_description_translated", pa.bool_()), ("untranslated_description", pa.string()),
    ("time_limit", pa.struct([("seconds", pa.int64()), ("nanos", pa.int64())])),
    ("memory_limit_bytes", pa.int64()), ("input_file", pa.string()), ("output_file", pa.string()),
])


def _contest(name: str, description: str, tests: list[list[tuple[str, str]]],
             time_limit: tuple[int, int], memory_limit_bytes: int,
             solution: str = SUM_SOLUTION) -> dict[str, Any]:
    public, private, generated = (
        {"input": [i for i, _ in t], "output": [o for _, o in t]} for t in tests
    )
    return {
        "name": name, "description": description, "public_tests": public,
        "private_tests": private, "generated_tests": generated, "source": 2, "difficulty": 7,
        "solutions": {"language": [3], "solution": [solution]},  # 3: PYTHON3
        "incorrect_solutions": {"language": [], "solution": []},
        "cf_contest_id": int(name.split("_")[0]), "cf_index": "A", "cf_points": 500.0,
        "cf_rating": 800, "cf_tags": ["implementation"], "is_description_translated": False,
        "untranslated_description": "",
        "time_limit": {"seconds": time_limit[0], "nanos": time_limit[1]},
        "memory_limit_bytes": memory_limit_bytes, "input_file": "", "output_file": "",
    }


def _flat(tests: list[list[tuple[str, str]]]) -> list[tuple[str, str, bool]]:
    """Cases of (public, private, generated) in that order; only the first group is public."""
    return [(i, o, group == 0) for group, t in enumerate(tests) for i, o in t]


def write_code_contests(directory: str) -> LayoutFixture:
    """code_contests: the three test groups in order, {seconds, nanos} and byte limits, an
    empty generated group, and private tests with an input but no output (bad)."""
    sum_desc = "Given two integers a and b, print a + b."
    max_desc = "Given n and n integers, print the largest of them."
    sum_tests = [[("1 2\n", "3\n")], [("5 6\n", "11\n")], [("0 0\n", "0\n"), ("-4 4\n", "0\n")]]
    max_tests = [[("3\n1 5 2\n", "5\n")], [("1\n-7\n", "-7\n")], []]
    pairs: list[Pair] = [
        (_contest("1000_A. Sum", sum_desc, sum_tests, (2, 500_000_000), 256_000_000),
         _ok(sum_desc, tests=_suite(_flat(sum_tests), None, 2.5, 256))),
        (_contest("1001_A. Max", max_desc, max_tests, (1, 0), 268_435_456, MAX_SOLUTION),
         _ok(max_desc, tests=_suite(_flat(max_tests), None, 1.0, 269))),
        ({**_contest("1002_A. Sum", sum_desc, sum_tests, (2, 0), 256_000_000),
          "private_tests": {"input": ["5 6\n", "7 8\n"], "output": ["11\n"]}},
         _bad("private_tests")),
    ]
    return _parquet(directory, "code_contests.parquet", "code", CODE_CONTESTS_SCHEMA, pairs)


WRITERS = (
    write_gsm8k, write_math, write_dapo, write_messages, write_code_apps,
    write_code_livecodebench, write_code_contests,
)
