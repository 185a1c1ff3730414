"""Reading a dataset: files -> raw records -> format adapter -> validated rows (docs/design.md §11).

``read_dataset`` accounts for every input row: a row of the result or a ``Rejected`` entry naming
its file, row, field and reason. ``load_dataset`` (training, evaluation, previews) returns the rows,
prompts normalized, and logs the rejected ones (never dropped silently)."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Mapping, Sequence

import pandas as pd

from rlax_tasks.data.errors import FieldError
from rlax_tasks.data.files import expand_inputs
from rlax_tasks.data.formats import DataFormat, convert_record, get_format
from rlax_tasks.data.normalize import normalize_prompt
from rlax_tasks.data.readers import RawTable, Rejected, read_inputs, snippet
from rlax_tasks.data.schema import SCHEMA_FIELDS, is_missing, validate

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class DatasetRows:
    """Valid rows (schema fields, ``origin_file``/``origin_row``) and every rejected input row."""

    frame: pd.DataFrame
    rejected: list[Rejected]
    rows_read: int
    files: list[str]
    format: DataFormat


def apply_format(raw: RawTable, fmt: DataFormat) -> tuple[RawTable, list[Rejected]]:
    """Raw records mapped to schema columns by ``fmt``; records it cannot map are rejected
    (stage "validate", naming the input column)."""
    frame = raw.frame
    if fmt.convert is None:  # the schema itself; a curated file's chat prompts are `messages`
        if "messages" in frame.columns:
            frame = frame.copy()
            prompts = frame["prompt"] if "prompt" in frame.columns else [None] * len(frame)
            frame["prompt"] = [
                m if is_missing(p) else p for p, m in zip(prompts, frame["messages"], strict=True)
            ]
            frame = frame.drop(columns=["messages"])
            columns = {f: [c for c in cols if c != "messages"] for f, cols in raw.columns.items()}
            columns = {f: sorted({*cols, "prompt"}) for f, cols in columns.items()}
            return RawTable(frame, raw.rejected, columns), []
        return raw, []
    names = [c for c in frame.columns if not str(c).startswith("_")]
    out: dict[str, list] = {f: [] for f in SCHEMA_FIELDS}
    origin_file, origin_row, rejected = [], [], []
    for values, file, row in zip(
        frame[names].itertuples(index=False, name=None),
        frame["_file"].tolist(),
        frame["_row"].tolist(),
        strict=True,
    ):
        record = {k: v for k, v in zip(names, values, strict=True) if not is_missing(v)}
        try:
            converted = convert_record(fmt, record)
        except FieldError as exc:
            field = exc.field or ""
            reason = f"{field}: {exc}" if field else str(exc)
            rejected.append(
                Rejected("validate", file, int(row), field, f"{reason} [format {fmt.name}]",
                         snippet(record))
            )  # fmt: skip
            continue
        for f in SCHEMA_FIELDS:
            out[f].append(converted.get(f))
        origin_file.append(file)
        origin_row.append(row)
    converted_frame = pd.DataFrame({f: pd.Series(v, dtype=object) for f, v in out.items()})
    converted_frame["_file"] = pd.Series(origin_file, dtype=object)
    converted_frame["_row"] = pd.Series(origin_row, dtype="int64")
    columns = {f: list(SCHEMA_FIELDS) for f in raw.columns}
    return RawTable(converted_frame, raw.rejected, columns), rejected


def read_dataset(
    paths: str | Sequence[str],
    format: str | DataFormat = "rlax",  # noqa: A002 - the user-facing name
    columns: Mapping[str, str] | None = None,
) -> DatasetRows:
    """Every row of the files under ``paths`` (files, directories, globs, gs://) read through
    ``format``; ``rows_read == len(frame) + len(rejected)``."""
    fmt = format if isinstance(format, DataFormat) else get_format(format, columns)
    files = [f for p in ([paths] if isinstance(paths, str) else paths) for f in expand_inputs(p)]
    raw = read_inputs(files)
    rows_read = raw.rows_read
    converted, unfit = apply_format(raw, fmt)
    frame, invalid = validate(converted)
    rejected = [*raw.rejected, *unfit, *invalid]
    if len(frame) + len(rejected) != rows_read:
        raise RuntimeError(f"row accounting broken: read {rows_read}, kept {len(frame)}, "
                           f"rejected {len(rejected)}")  # fmt: skip
    return DatasetRows(frame, rejected, rows_read, files, fmt)


def row_id(prompt: object) -> str:
    """A stable id of a row from its prompt (16 hex digits)."""
    text = prompt if isinstance(prompt, str) else repr(prompt)
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def load_dataset(
    path: str,
    format: str | DataFormat = "rlax",  # noqa: A002 - the user-facing name
    columns: Mapping[str, str] | None = None,
    limit: int | None = None,
) -> DatasetRows:
    """The rows of a dataset for training or evaluation: prompts normalized, each row with a
    reference (answer or tests) and an ``id``; rows that cannot be used are in ``rejected``
    and logged. No usable row at all is an error."""
    rows = read_dataset(path, format, columns)
    frame = rows.frame
    no_ref = [
        i
        for i, (a, t) in enumerate(zip(frame["answer"], frame["tests"], strict=True))
        if a is None and not t
    ]
    if no_ref:
        for i in no_ref:
            rows.rejected.append(
                Rejected("validate", frame["origin_file"].iat[i], int(frame["origin_row"].iat[i]),
                         "answer,tests", "no answer and no tests: nothing to verify against",
                         snippet(frame["prompt"].iat[i]))
            )  # fmt: skip
        frame = frame.drop(index=no_ref).reset_index(drop=True)
    if len(frame) == 0:
        first = rows.rejected[0] if rows.rejected else None
        why = f"; first: {first.file} row {first.row}: {first.reason}" if first else ""
        raise ValueError(f"dataset {path} (format {rows.format.name}) has no usable rows{why}")
    if rows.rejected:
        first = rows.rejected[0]
        logger.warning(
            "dataset %s (format %s): %d of %d rows cannot be used and are skipped; first: %s "
            "row %d: %s (`rlax data preview` or `rlax curate` lists them all)",
            path, rows.format.name, len(rows.rejected), rows.rows_read, first.file, first.row,
            first.reason,
        )  # fmt: skip
    frame["prompt"] = pd.Series([normalize_prompt(p) for p in frame["prompt"]], dtype=object)
    ids = [m.get("id") if isinstance(m, dict) else None for m in frame["metadata"]]
    frame.insert(0, "id", [str(i) if i is not None else row_id(p)
                           for i, p in zip(ids, frame["prompt"], strict=True)])  # fmt: skip
    if limit is not None:
        frame = frame.head(limit).reset_index(drop=True)
    rows.frame = frame
    return rows


__all__ = ["DatasetRows", "apply_format", "load_dataset", "read_dataset", "row_id"]
