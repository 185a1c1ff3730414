"""The dataset row schema (docs/design.md §11) and per-row validation of raw input rows. A row:
``prompt`` (text, or chat messages [{role, content}] ending with a user message), ``answer`` and/or
``tests`` (``rlax_tasks.data.code_tests``), optional ``source`` (str), ``date`` (ISO) and
``metadata`` (a JSON object keeping unknown input columns). Validation gives a clean row or a
quarantine entry naming every bad field."""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from rlax_tasks.data.code_tests import CodeTests
from rlax_tasks.data.errors import FieldError
from rlax_tasks.data.readers import RawTable, Rejected, snippet

if TYPE_CHECKING:  # pandas loads when rows are validated (readers.py says why)
    import pandas as pd

SCHEMA_FIELDS = ("prompt", "answer", "tests", "source", "date", "metadata")
REQUIRED = ("prompt",)
ROLES = ("system", "user", "assistant")

# a chat prompt: [{"role": "system" | "user" | "assistant", "content": str}, ...]
Messages = list[dict[str, str]]
Prompt = str | Messages


def is_missing(value: object) -> bool:
    """None, NaN, pd.NA and NaT all mean "no value"."""
    if value is None:
        return True
    if isinstance(value, float):
        return math.isnan(value)
    pd = sys.modules.get("pandas")  # pd.NA and NaT exist only once pandas is loaded
    return pd is not None and (value is pd.NA or value is pd.NaT)


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


def _check_text(value: object) -> str:
    text = _text(value)
    if not text.strip():
        raise FieldError("empty")
    return text


def check_messages(value: object) -> Messages:
    """A chat prompt: non-empty {role, content} messages whose last one is the user's."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if not isinstance(value, list | tuple) or not value:
        raise FieldError(f"expected a non-empty list of chat messages, got {snippet(value)}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise FieldError(f"message {i}: expected {{role, content}}, got {snippet(message)}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise FieldError(f"message {i}: role must be one of {list(ROLES)}, got {role!r}")
        if content is None or (isinstance(content, float) and math.isnan(content)):
            raise FieldError(f"message {i} ({role}) has no content")
        try:
            out.append({"role": role, "content": _check_text(content)})
        except FieldError as exc:
            raise FieldError(f"message {i} ({role}) content: {exc}") from None
    if out[-1]["role"] != "user":
        raise FieldError(
            f"the last message is from the {out[-1]['role']}; a prompt ends with a user message "
            "(the model writes the assistant's reply)"
        )
    return out


def check_prompt(value: object) -> Prompt:
    """Prompt text, or chat messages (a list, or its JSON text starting with '[')."""
    if isinstance(value, list | tuple | np.ndarray):
        return check_messages(value)
    text = _check_text(value)
    if text.lstrip().startswith("[{"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return text
        if (
            isinstance(parsed, list)
            and parsed
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in parsed)
        ):
            return check_messages(parsed)
    return text


def prompt_text(prompt: Prompt) -> str:
    """The problem text of a prompt: itself, or its user messages joined (what dedup,
    decontamination and filters read; a shared system message is not part of the problem)."""
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(m["content"] for m in prompt if m["role"] == "user")


def check_source(value: object) -> str:
    return _check_text(value)


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


def check_tests(value: object) -> dict[str, Any] | None:
    """A code test suite as plain data (``CodeTests.to_dict``); empty text means none."""
    if isinstance(value, str | bytes) and not _text(value).strip():
        return None
    return CodeTests.from_value(value).to_dict()


def check_date(value: object) -> str:
    if isinstance(value, dt.datetime):  # pd.Timestamp too (a datetime subclass)
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
    if isinstance(value, dt.date):  # datetime and pd.Timestamp are subclasses
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
    import pandas as pd  # lazy: as in readers.py

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
