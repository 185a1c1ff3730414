"""The test suite of a code problem, stored in a row's ``tests`` field as plain data:
``{"cases": [{"input": "1 2\\n", "output": "3\\n", "public": true}, ...], "fn_name": null,
"time_limit_s": 2.0, "memory_mb": 256}``. With ``fn_name`` set, input and output are the JSON texts
of the argument list and the return value; limits None mean the judge's defaults. A bare list of
{input, output} objects (the older layout) reads as public cases without limits."""

from __future__ import annotations

import dataclasses
import json
import keyword
import math
from collections.abc import Mapping
from typing import Any

from rlax_tasks.data.errors import FieldError
from rlax_tasks.data.plain import plain


@dataclasses.dataclass(frozen=True)
class CodeCase:
    """One test: stdin text and expected stdout, or JSON arguments and JSON return value."""

    input: str
    output: str
    public: bool = True


@dataclasses.dataclass(frozen=True)
class CodeTests:
    """A problem's test cases, its entry point for call-based problems and its limits."""

    cases: tuple[CodeCase, ...]
    fn_name: str | None = None
    time_limit_s: float | None = None
    memory_mb: int | None = None

    @property
    def call_based(self) -> bool:
        return self.fn_name is not None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON / Parquet struct); ``from_value`` reads it back."""
        return {
            "cases": [dataclasses.asdict(c) for c in self.cases],
            "fn_name": self.fn_name,
            "time_limit_s": self.time_limit_s,
            "memory_mb": self.memory_mb,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_value(cls, value: Any) -> CodeTests:
        """A suite from its dict, a JSON string of it, or a list of {input, output} objects;
        FieldError says what is wrong (which case, which key)."""
        if isinstance(value, CodeTests):
            return value
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise FieldError(f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
        value = plain(value)
        if isinstance(value, list):
            value = {"cases": value}
        if not isinstance(value, Mapping):
            raise FieldError(
                f"expected a test suite ({{cases, fn_name, time_limit_s, memory_mb}}) or a list "
                f"of {{input, output}} objects, got {type(value).__name__}"
            )
        unknown = sorted(set(value) - {"cases", "fn_name", "time_limit_s", "memory_mb"})
        if unknown:
            raise FieldError(f"unknown test-suite key(s) {unknown}")
        raw_cases = value.get("cases")
        if not isinstance(raw_cases, list):
            raise FieldError(f"cases: expected a list, got {type(raw_cases).__name__}")
        cases = tuple(_case(i, c) for i, c in enumerate(raw_cases))
        if not cases:
            raise FieldError("cases: no test cases")
        fn_name = value.get("fn_name")
        if fn_name is not None and (
            not isinstance(fn_name, str) or not fn_name.isidentifier() or keyword.iskeyword(fn_name)
        ):
            raise FieldError(f"fn_name: expected a Python identifier, got {fn_name!r}")
        if fn_name is not None:
            for i, c in enumerate(cases):
                _json_text(c.input, f"cases[{i}].input (call-based: a JSON list of arguments)")
                _json_text(c.output, f"cases[{i}].output (call-based: the JSON return value)")
                if not isinstance(json.loads(c.input), list):
                    raise FieldError(f"cases[{i}].input: call-based inputs are a JSON list of args")
        return cls(
            cases,
            fn_name,
            _positive(value.get("time_limit_s"), "time_limit_s", float),
            _positive(value.get("memory_mb"), "memory_mb", int),
        )


def _case(i: int, case: Any) -> CodeCase:
    if not isinstance(case, Mapping):
        raise FieldError(f"cases[{i}]: expected an object with input and output, got {case!r}")
    missing = [k for k in ("input", "output") if case.get(k) is None]
    if missing:
        raise FieldError(f"cases[{i}] has no {' or '.join(missing)}")
    texts = []
    for key in ("input", "output"):
        v = case[key]
        if not isinstance(v, str):
            raise FieldError(f"cases[{i}].{key}: expected a string, got {type(v).__name__}")
        texts.append(v)
    public = case.get("public", True)
    if not isinstance(public, bool):
        raise FieldError(f"cases[{i}].public: expected true or false, got {public!r}")
    return CodeCase(texts[0], texts[1], public)


def _json_text(text: str, what: str) -> None:
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise FieldError(f"{what}: not valid JSON ({exc.msg})") from exc


def _positive(value: Any, name: str, kind: type) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise FieldError(f"{name}: expected a positive number or null, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise FieldError(f"{name}: expected a positive number, got {value!r}")
    return float(value) if kind is float else int(math.ceil(value))
