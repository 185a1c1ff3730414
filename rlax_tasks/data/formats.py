r"""Format adapters: public dataset layouts mapped to rows of the schema (docs/design.md §11),
listed in ``FORMATS`` plus ``columns`` (the user's own field -> column mapping). An adapter reads
one raw record and returns the schema fields, or raises a ``FieldError`` naming the column at fault:
the record is then quarantined with that reason, never dropped. Unread columns go to
``metadata``."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from rlax_tasks.data.answers import gsm8k_answer, last_boxed
from rlax_tasks.data.code_tests import CodeTests
from rlax_tasks.data.errors import FieldError
from rlax_tasks.data.plain import plain
from rlax_tasks.data.schema import (
    SCHEMA_FIELDS,
    check_answer,
    check_date,
    check_messages,
    check_prompt,
    check_source,
    check_tests,
    is_missing,
)
from rlax_tasks.utils.validation import did_you_mean

Record = Mapping[str, Any]
Row = dict[str, Any]

VERIFIERS = ("math", "code")


@dataclasses.dataclass(frozen=True)
class DataFormat:
    """A named adapter: ``convert(record) -> row`` and the verifier its references need."""

    name: str
    convert: Callable[[Record], Row] | None  # None: the record is already a schema row
    verifier: str = "math"
    description: str = ""


# --------------------------------------------------------------------------- helpers
def _get(record: Record, column: str) -> Any:
    value = record.get(column)
    return None if is_missing(value) else value


def _take(record: Record, column: str, check: Callable[[Any], Any], what: str = "") -> Any:
    """``check(record[column])`` with errors naming the column; missing is an error."""
    value = _get(record, column)
    if value is None:
        present = [c for c in record if not str(c).startswith("_")]
        raise FieldError(
            f"missing{f' ({what})' if what else ''}; the row has {', '.join(present) or 'nothing'}",
            column,
        )
    try:
        return check(value)
    except FieldError as exc:
        raise FieldError(str(exc), column) from None


def _first(record: Record, columns: tuple[str, ...]) -> str | None:
    """The first of ``columns`` the record has a value in."""
    return next((c for c in columns if _get(record, c) is not None), None)


def _json(value: Any, column: str) -> Any:
    """A column holding JSON text (or the decoded value already)."""
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if not isinstance(value, str):
        return plain(value)
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        hint = ""
        if column.endswith("test_cases") and not value.lstrip().startswith(("[", "{")):
            hint = (
                " (LiveCodeBench ships private tests as a compressed pickle, which is never "
                "loaded: decode them to JSON first)"
            )
        raise FieldError(f"not valid JSON ({exc.msg} at column {exc.colno}){hint}", column) from exc


def _rest(record: Record, used: set[str], **extra: Any) -> dict[str, Any]:
    """Metadata: the columns not used (missing values left out) plus ``extra``."""
    meta = {k: plain(v) for k, v in record.items() if k not in used and not is_missing(v)}
    meta.update({k: v for k, v in extra.items() if v is not None})
    return meta


# --------------------------------------------------------------------------- math formats
def _gsm8k(record: Record) -> Row:
    prompt = _take(record, "question", check_prompt)
    solution = _take(record, "answer", _text_value)
    answer = gsm8k_answer(solution)
    if answer is None:
        raise FieldError(
            "no final '#### <number>' line (GSM8K puts the reference number after ####)", "answer"
        )
    return {
        "prompt": prompt,
        "answer": answer,
        "metadata": _rest(record, {"question", "answer"}, solution=solution),
    }


_LEVEL_RE = re.compile(r"^\s*Level\s+(\d+)\s*$")


def _math(record: Record) -> Row:
    prompt = _take(record, "problem", check_prompt)
    solution = _get(record, "solution")
    answer = last_boxed(solution) if isinstance(solution, str) else None
    if not answer and _get(record, "answer") is not None:
        answer = _take(record, "answer", check_answer)
    if not answer:
        column = "solution" if solution is not None else "answer"
        raise FieldError(
            r"no \boxed{...} answer in the solution and no answer column "
            "(MATH's reference is the last \\boxed{} of the solution)",
            column,
        )
    level = _get(record, "level")
    match = _LEVEL_RE.match(level) if isinstance(level, str) else None
    return {
        "prompt": prompt,
        "answer": answer,
        "metadata": _rest(
            record,
            {"problem", "answer", "level"},
            level=int(match.group(1)) if match else level,
        ),
    }


def _dapo(record: Record) -> Row:
    prompt = _take(record, "prompt", lambda v: check_messages(plain(v)), "a chat-message list")
    reward_model = _take(record, "reward_model", plain)
    truth = reward_model.get("ground_truth") if isinstance(reward_model, Mapping) else None
    try:
        answer = None if truth is None else check_answer(truth)
    except FieldError as exc:
        raise FieldError(f"ground_truth: {exc}", "reward_model") from None
    if answer is None:
        raise FieldError("no ground_truth (DAPO's reference answer)", "reward_model")
    source = _get(record, "data_source")
    extra = plain(_get(record, "extra_info")) or {}
    return {
        "prompt": prompt,
        "answer": answer,
        "source": None if source is None else _take(record, "data_source", check_source),
        "metadata": _rest(
            record,
            {"prompt", "reward_model", "data_source"},
            id=extra.get("index") if isinstance(extra, Mapping) else None,
            reward_style=reward_model.get("style"),
        ),
    }


def _messages(record: Record) -> Row:
    column = _first(record, ("messages", "prompt")) or "messages"
    prompt = _take(record, column, lambda v: check_messages(plain(v)), "a chat-message list")
    answer = _take(record, "answer", check_answer)
    if answer is None:
        raise FieldError("empty", "answer")
    return {"prompt": prompt, "answer": answer, "metadata": _rest(record, {column, "answer"})}


# --------------------------------------------------------------------------- code
CODE_PROMPT_COLUMNS = ("question", "question_content", "description", "problem", "prompt")
_SECONDS_RE = re.compile(r"^\s*([\d.]+)\s*(?:s|sec|secs|second|seconds)?\s*$", re.IGNORECASE)
_MEGABYTES_RE = re.compile(r"^\s*([\d.]+)\s*(?:mb|mib|m|megabyte|megabytes)?\s*$", re.IGNORECASE)


def _text_value(value: Any) -> str:
    if not isinstance(value, str):
        raise FieldError(f"expected text, got {type(value).__name__}")
    if not value.strip():
        raise FieldError("empty")
    return value


def _io_text(value: Any) -> str:
    """A stdin/stdout case value: text (a list of lines is joined)."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    if not isinstance(value, str):
        raise FieldError(f"expected text, got {type(value).__name__} {value!r}")
    return value


def _seconds(value: Any, column: str) -> float | None:
    """A time limit: seconds as a number, "2 seconds", or code_contests' {seconds, nanos}."""
    value = plain(value)
    if isinstance(value, Mapping):
        return float(value.get("seconds") or 0) + float(value.get("nanos") or 0) / 1e9 or None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value) if value > 0 else None
    if isinstance(value, str):
        if value.strip().lower() in ("", "none", "null"):
            return None
        match = _SECONDS_RE.match(value)
        if match:
            return float(match.group(1)) or None
    raise FieldError(f"not a time limit in seconds: {value!r}", column)


def _megabytes(record: Record) -> int | None:
    if _get(record, "memory_limit_bytes") is not None:
        value = _get(record, "memory_limit_bytes")
        # code_contests' protobuf int64: 0 means "not set" (like a null time_limit); its byte
        # counts are decimal ("256 megabytes" is 256000000), so they read back as the stated MB
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
            return math.ceil(value / 1e6) or None
        raise FieldError(f"not a number of bytes: {value!r}", "memory_limit_bytes")
    value = _get(record, "memory_limit")
    if value is None:
        return None
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return math.ceil(value)
    match = _MEGABYTES_RE.match(value) if isinstance(value, str) else None
    if match and float(match.group(1)) > 0:
        return math.ceil(float(match.group(1)))
    if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
        return None
    raise FieldError(f"not a memory limit in megabytes: {value!r}", "memory_limit")


def _input_output_cases(record: Record) -> tuple[list[dict], str | None]:
    """APPS / TACO: {"inputs": [...], "outputs": [...], "fn_name"?}, all cases public."""
    io = _json(_get(record, "input_output"), "input_output")
    if not isinstance(io, Mapping):
        raise FieldError("expected a JSON object with inputs and outputs", "input_output")
    inputs, outputs, fn_name = io.get("inputs"), io.get("outputs"), io.get("fn_name")
    if not isinstance(inputs, list) or not isinstance(outputs, list):
        raise FieldError("needs 'inputs' and 'outputs' lists", "input_output")
    if len(inputs) != len(outputs):
        raise FieldError(f"{len(inputs)} inputs but {len(outputs)} outputs", "input_output")
    cases = []
    for i, (inp, out) in enumerate(zip(inputs, outputs, strict=True)):
        try:
            if fn_name is not None:
                if not isinstance(inp, list):
                    raise FieldError(f"a call-based input is a list of arguments, got {inp!r}")
                cases.append({"input": json.dumps(inp), "output": json.dumps(out)})
            else:
                cases.append({"input": _io_text(inp), "output": _io_text(out)})
        except FieldError as exc:
            raise FieldError(f"case {i}: {exc}", "input_output") from None
    return [{**c, "public": True} for c in cases], fn_name


def _functional_input(text: str) -> str:
    """LiveCodeBench functional input: one JSON value per line -> the JSON argument list."""
    return json.dumps([json.loads(line) for line in text.split("\n") if line.strip()])


def _pair_cases(record: Record, column: str, public: bool) -> tuple[list[dict], bool]:
    """Cases of a list of {input, output[, testtype]} or a dict of input/output lists;
    (cases, whether they are functional)."""
    value = _json(_get(record, column), column)
    if isinstance(value, Mapping) and ("input" in value or "output" in value):
        inputs, outputs = value.get("input") or [], value.get("output") or []
        if len(inputs) != len(outputs):
            raise FieldError(f"{len(inputs)} inputs but {len(outputs)} outputs", column)
        value = [{"input": i, "output": o} for i, o in zip(inputs, outputs, strict=True)]
    if not isinstance(value, list):
        raise FieldError("expected a list of {input, output} test cases", column)
    cases, functional = [], False
    for i, case in enumerate(value):
        if not isinstance(case, Mapping) or case.get("input") is None or case.get("output") is None:
            raise FieldError(f"case {i} has no input or no output: {case!r}"[:300], column)
        try:
            inp, out = _io_text(case["input"]), _io_text(case["output"])
            if case.get("testtype") == "functional":
                functional = True
                inp = _functional_input(inp)
                json.loads(out)
        except (FieldError, json.JSONDecodeError) as exc:
            raise FieldError(f"case {i}: {exc}", column) from None
        cases.append({"input": inp, "output": out, "public": public})
    return cases, functional


_PAIR_COLUMNS = (
    ("public_tests", True),
    ("public_test_cases", True),
    ("private_tests", False),
    ("private_test_cases", False),
    ("generated_tests", False),
    ("tests", True),
)


def _fn_name(record: Record) -> str | None:
    if _get(record, "fn_name") is not None:
        return str(_get(record, "fn_name"))
    meta = _get(record, "metadata")
    meta = _json(meta, "metadata") if meta is not None else None
    if isinstance(meta, Mapping):
        name = meta.get("func_name") or meta.get("fn_name")
        return None if name is None else str(name)
    return None


def _code(record: Record) -> Row:
    """Test cases in the APPS/TACO (``input_output``), LiveCodeBench (``public_test_cases`` /
    ``private_test_cases``) or code_contests (``public_tests`` / ``private_tests`` /
    ``generated_tests``) layouts, with per-problem limits."""
    column = _first(record, CODE_PROMPT_COLUMNS)
    if column is None:
        raise FieldError(
            f"no problem statement (looked for {', '.join(CODE_PROMPT_COLUMNS)})",
            CODE_PROMPT_COLUMNS[0],
        )
    prompt = _take(record, column, _text_value)
    starter = _get(record, "starter_code")
    if isinstance(starter, str) and starter.strip():
        prompt = f"{prompt}\n\n```python\n{starter.rstrip()}\n```"
    used = {column, "starter_code", "input_output", "time_limit", "memory_limit"}
    used |= {"memory_limit_bytes", "fn_name"}
    cases: list[dict] = []
    fn_name = None
    functional = False
    if _get(record, "input_output") is not None:
        cases, fn_name = _input_output_cases(record)
    for name, public in _PAIR_COLUMNS:
        if _get(record, name) is not None:
            more, is_functional = _pair_cases(record, name, public)
            cases += more
            functional |= is_functional
            used.add(name)
    if not cases:
        raise FieldError(
            "no test cases (looked for input_output, public/private tests)", "input_output"
        )
    if functional:
        fn_name = fn_name or _fn_name(record)
        if fn_name is None:
            raise FieldError(
                "functional tests need the function name (metadata.func_name)", "metadata"
            )
        used.add("metadata")
    limit = _get(record, "time_limit")
    suite = {
        "cases": cases,
        "fn_name": fn_name,
        "time_limit_s": None if limit is None else _seconds(limit, "time_limit"),
        "memory_mb": _megabytes(record),
    }
    try:
        tests = check_tests(suite)
    except FieldError as exc:
        test_columns = [c for c in ("input_output", *(n for n, _ in _PAIR_COLUMNS)) if c in used]
        column = "metadata" if str(exc).startswith("fn_name") and functional else test_columns[0]
        raise FieldError(str(exc), column) from None
    # LiveCodeBench dates its problems (contest_date): a time split keeps evaluation clean
    date_column = _first(record, ("date", "contest_date"))
    date = None
    if date_column is not None:
        date = _take(record, date_column, check_date)
        used.add(date_column)
    return {"prompt": prompt, "tests": tests, "date": date, "metadata": _rest(record, used)}


# --------------------------------------------------------------------------- user mapping
COLUMN_CHECKS: dict[str, Callable[[Any], Any]] = {
    "prompt": lambda v: check_prompt(plain(v)),
    "answer": check_answer,
    "tests": lambda v: check_tests(CodeTests.from_value(v)),
    "source": check_source,
    "date": check_date,
}


def columns_format(mapping: Mapping[str, str]) -> DataFormat:
    """The ``columns`` format for ``mapping`` (schema field -> input column); needs prompt and
    answer or tests."""
    if not isinstance(mapping, Mapping) or not mapping:
        raise ValueError(
            "format 'columns' needs a mapping of fields to columns, e.g. "
            "{prompt: question, answer: final_answer} (on the command line: "
            "--columns prompt=question,answer=final_answer)"
        )
    unknown = sorted(set(mapping) - set(COLUMN_CHECKS))
    if unknown:
        raise ValueError(
            f"columns: unknown field(s) {unknown}; map any of {', '.join(COLUMN_CHECKS)}"
        )
    bad = {k: v for k, v in mapping.items() if not isinstance(v, str) or not v}
    if bad:
        raise ValueError(f"columns: each field maps to a column name, got {bad}")
    if "prompt" not in mapping or not {"answer", "tests"} & set(mapping):
        raise ValueError(
            "columns: map prompt and answer (math) or tests (code), e.g. "
            "{prompt: question, answer: final_answer}"
        )
    mapping = dict(mapping)

    def convert(record: Record) -> Row:
        row: Row = {}
        for field, column in mapping.items():
            value = _get(record, column)
            if value is None:
                if field == "prompt":
                    _take(record, column, str)  # raises "missing", naming the column
                continue
            try:
                row[field] = COLUMN_CHECKS[field](value)
            except FieldError as exc:
                raise FieldError(str(exc), column) from None
        if row.get("answer") is None and row.get("tests") is None:
            columns = " / ".join(mapping[f] for f in ("answer", "tests") if f in mapping)
            raise FieldError("empty: the row has no reference to verify against", columns)
        row["metadata"] = _rest(record, set(mapping.values()))
        return row

    verifier = "math" if "answer" in mapping else "code"
    return DataFormat("columns", convert, verifier, f"the mapping {mapping}")


FORMATS: dict[str, DataFormat] = {
    f.name: f
    for f in (
        DataFormat("rlax", None, "math", "the row schema: prompt/messages, answer, tests, ..."),
        DataFormat("gsm8k", _gsm8k, "math", "question; the number after #### in answer"),
        DataFormat("math", _math, "math", r"problem; the last \boxed{} of solution"),
        DataFormat("dapo", _dapo, "math", "chat-message prompt; reward_model.ground_truth"),
        DataFormat("messages", _messages, "math", "chat messages with an answer column"),
        DataFormat("code", _code, "code", "a problem statement with stdin/stdout or call tests"),
    )
}
FORMAT_NAMES = (*FORMATS, "columns")


def get_format(name: str, columns: Mapping[str, str] | None = None) -> DataFormat:
    """The format called ``name`` (``columns`` needs its mapping); ValueError lists the names."""
    if name == "columns":
        return columns_format(columns or {})
    if columns:
        raise ValueError(f"columns: only for format 'columns', not {name!r}")
    if name not in FORMATS:
        hint = did_you_mean(name, FORMAT_NAMES)
        raise ValueError(
            f"unknown dataset format {name!r}{hint}; formats: {', '.join(FORMAT_NAMES)}"
        )
    return FORMATS[name]


def convert_record(fmt: DataFormat, record: Record) -> Row:
    """The schema fields of one raw record under ``fmt`` (FieldError names the column)."""
    if fmt.convert is None:
        row = {k: record[k] for k in SCHEMA_FIELDS if k in record}
        if _get(row, "prompt") is None and _get(record, "messages") is not None:
            row["prompt"] = plain(record["messages"])
        return row
    return fmt.convert(record)
