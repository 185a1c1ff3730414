"""The curated row schema and per-row validation of raw input rows.

A curated row has: prompt (str), answer (str) and/or tests (list of {input, output} strings),
source (str), date (ISO date), metadata (a JSON object; unknown input columns are kept in it).
Validation turns each raw row into a clean row or a quarantine entry naming every bad field.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from rlax_tasks.curation.ingest import RawTable, Rejected, snippet

SCHEMA_FIELDS = ("prompt", "answer", "tests", "source", "date", "metadata")
REQUIRED = ("prompt", "source", "date")
# columns of a curated dataset, in output order (pass_rate is added by the pass-rate filter)
OUTPUT_COLUMNS = (
    "id",
    "prompt",
    "answer",
    "tests",
    "source",
    "date",
    "metadata",
    "origin_file",
    "origin_row",
)


class FieldError(ValueError):
    """A raw value that does not fit its field."""


def is_missing(value: object) -> bool:
    """None, NaN, pd.NA and NaT all mean "no value"."""
    if value is None or value is pd.NA or value is pd.NaT:
        return True
    return isinstance(value, float) and math.isnan(value)


def _text(value: object, what: str = "a string") -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FieldError(
                f"not valid UTF-8 (byte 0x{value[exc.start]:02x} at offset {exc.start})"
            ) from exc
    if not isinstance(value, str):
        raise FieldError(f"expected {what}, got {type(value).__name__} {snippet(value)}")
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise FieldError(f"invalid Unicode (lone surrogate at character {exc.start})") from exc
    return value


def check_prompt(value: object) -> str:
    text = _text(value)
    if not text.strip():
        raise FieldError("empty")
    return text


def check_source(value: object) -> str:
    return check_prompt(value)


def check_answer(value: object) -> str | None:
    if isinstance(value, bool):
        raise FieldError(f"expected a string or number, got bool {value!r}")
    if isinstance(value, int | np.integer):
        return str(int(value))
    if isinstance(value, float | np.floating):
        if not math.isfinite(value):
            raise FieldError(f"expected a string or finite number, got {value!r}")
        return repr(float(value))
    text = _text(value, "a string or number").strip()
    return text or None


def check_tests(value: object) -> list[dict[str, str]] | None:
    if isinstance(value, str | bytes):
        text = _text(value)
        if not text.strip():
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FieldError(f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, list | tuple):
        raise FieldError(
            f"expected a list of {{input, output}} objects, got {type(value).__name__}"
        )
    tests = []
    for i, case in enumerate(value):
        if not isinstance(case, dict):
            raise FieldError(
                f"tests[{i}] must be an object with input and output, got {type(case).__name__}"
            )
        missing = [k for k in ("input", "output") if k not in case or is_missing(case[k])]
        if missing:
            raise FieldError(f"tests[{i}] has no {' or '.join(missing)}")
        try:
            tests.append({"input": _text(case["input"]), "output": _text(case["output"])})
        except FieldError as exc:
            raise FieldError(f"tests[{i}]: {exc}") from exc
    return tests or None


def check_date(value: object) -> str:
    if isinstance(value, pd.Timestamp | dt.datetime):
        return value.date().isoformat()
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, np.datetime64):
        return str(value.astype("datetime64[D]"))
    text = _text(value, "an ISO date string").strip()
    try:
        if len(text) == 10:
            return dt.date.fromisoformat(text).isoformat()
        return dt.datetime.fromisoformat(text).date().isoformat()
    except ValueError as exc:
        raise FieldError(f"not an ISO date (YYYY-MM-DD): {text!r}") from exc


def _json_default(value: object) -> object:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dt.date | dt.datetime | pd.Timestamp):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def check_metadata(value: object) -> dict[str, Any]:
    if isinstance(value, str | bytes):
        text = _text(value)
        if not text.strip():
            return {}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise FieldError(f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
        if not isinstance(value, dict):
            raise FieldError(f"expected a JSON object, got {type(value).__name__}")
        return value  # parsed JSON holds only JSON types
    if isinstance(value, list | np.ndarray) and all(
        isinstance(p, tuple) and len(p) == 2 for p in value
    ):
        value = dict(value)  # an Arrow map column
    if not isinstance(value, dict):
        raise FieldError(f"expected a JSON object, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(value, default=_json_default))
    except (TypeError, ValueError) as exc:
        raise FieldError(f"not JSON-serializable: {exc}") from exc


CHECKS: dict[str, Callable[[object], Any]] = {
    "prompt": check_prompt,
    "answer": check_answer,
    "tests": check_tests,
    "source": check_source,
    "date": check_date,
    "metadata": check_metadata,
}


def validate(raw: RawTable) -> tuple[pd.DataFrame, list[Rejected]]:
    """Clean rows (schema fields + origin_file/origin_row) and one quarantine entry per
    invalid row naming each bad field and why."""
    frame = raw.frame
    n = len(frame)
    files = frame["_file"].tolist() if n else []
    has_column = {f: set(cols) for f, cols in raw.columns.items()}
    errors: dict[int, list[tuple[str, str]]] = {}  # row -> (field, reason), bad rows only
    clean: dict[str, list[Any]] = {}
    for name, check in CHECKS.items():
        values = frame[name].tolist() if name in frame.columns else [None] * n
        out: list[Any] = [None] * n
        for i, value in enumerate(values):
            if is_missing(value):
                if name in REQUIRED:
                    absent = name not in has_column.get(files[i], ())
                    errors.setdefault(i, []).append(
                        (
                            name,
                            f"missing ({files[i]} has no {name!r} column)" if absent else "missing",
                        )
                    )
                elif name == "metadata":
                    out[i] = {}
                continue
            try:
                out[i] = check(value)
            except FieldError as exc:
                errors.setdefault(i, []).append((name, str(exc)))
        clean[name] = out
    extras = [c for c in frame.columns if c not in SCHEMA_FIELDS and not c.startswith("_")]
    if extras:  # unknown columns are kept in metadata, never dropped
        extra_values = {c: frame[c].tolist() for c in extras}
        for i in range(n):
            meta = clean["metadata"][i]
            if meta is None:
                continue
            for c in extras:
                v = extra_values[c][i]
                if not is_missing(v) and c not in meta:
                    try:
                        meta[c] = json.loads(json.dumps(v, default=_json_default))
                    except (TypeError, ValueError):
                        meta[c] = str(v)
    rejected = []
    rows = frame["_row"].tolist() if n else []
    bad = sorted(errors)
    for i in bad:
        record = {c: frame[c].iat[i] for c in frame.columns if not c.startswith("_")}
        rejected.append(
            Rejected(
                "validate",
                files[i],
                int(rows[i]),
                ",".join(f for f, _ in errors[i]),
                "; ".join(f"{f}: {msg}" for f, msg in errors[i]),
                snippet({k: v for k, v in record.items() if not is_missing(v)}),
            )
        )
    keep = np.ones(n, bool)
    keep[bad] = False
    out = pd.DataFrame({name: pd.Series(clean[name], dtype=object) for name in CHECKS})
    out["origin_file"] = pd.Series(files, dtype=object)
    out["origin_row"] = np.asarray(rows, dtype=np.int64)
    out = out[keep].reset_index(drop=True)
    return out, rejected
