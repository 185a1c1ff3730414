"""Reading JSONL, Parquet and CSV into one raw table, without losing a row: each record becomes a
row (values as read, not validated) or a quarantine entry saying why (broken JSON, non-UTF-8, a
CSV record with the wrong field count). ``_file`` and ``_row`` say where a row came from; ``_row``
is 1-based: the JSONL line, the CSV data record (header excluded) or the Parquet row."""

from __future__ import annotations

import csv
import io
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from rlax_tasks.data.files import file_format, read_bytes

if TYPE_CHECKING:  # lazy below: pandas and pyarrow load only when a file is read (every `rlax`
    import pandas as pd  # command imports this module through its CLI)

logger = logging.getLogger(__name__)

_RAW_CHARS = 300
_MISSING = object()


@dataclass(frozen=True)
class Rejected:
    """One input row that is not in the output, and why (`stage` names the step that
    rejected it; `field` the offending field, or "" when the whole record is unreadable)."""

    stage: str
    file: str
    row: int
    field: str
    reason: str
    raw: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def snippet(value: object) -> str:
    """A short printable form of a raw value, for quarantine entries."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= _RAW_CHARS else text[:_RAW_CHARS] + "..."


@dataclass
class RawTable:
    """Rows as read (`_file`, `_row` columns added) and the records that could not be read."""

    frame: pd.DataFrame
    rejected: list[Rejected] = field(default_factory=list)
    columns: dict[str, list[str]] = field(default_factory=dict)  # file -> its columns

    @property
    def rows_read(self) -> int:
        return len(self.frame) + len(self.rejected)


def _jsonl_records(path: str, data: bytes) -> tuple[list[dict], list[int], list[Rejected]]:
    records, rows, rejected = [], [], []
    offset = 0
    for lineno, line in enumerate(data.split(b"\n"), start=1):
        start, offset = offset, offset + len(line) + 1
        if not line.strip():
            continue  # blank lines are not records

        def reject(reason: str, text: str, lineno: int = lineno) -> None:
            rejected.append(Rejected("ingest", path, lineno, "", reason, snippet(text)))

        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            reject(
                f"not valid UTF-8: byte 0x{line[exc.start]:02x} at byte offset "
                f"{start + exc.start} of the file",
                line.decode("utf-8", "replace"),
            )
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            reject(f"broken JSON: {exc.msg} at column {exc.colno}", text)
            continue
        if not isinstance(obj, dict):
            reject(f"expected a JSON object per line, got {type(obj).__name__}", text)
            continue
        records.append(obj)
        rows.append(lineno)
    return records, rows, rejected


def _has_surrogates(text: str) -> bool:
    return not text.isascii() and any("\udc80" <= ch <= "\udcff" for ch in text)


def _csv_records(path: str, data: bytes) -> tuple[list[dict], list[int], list[Rejected]]:
    text = data.decode("utf-8-sig", "surrogateescape")  # bad bytes -> lone surrogates
    reader = csv.DictReader(io.StringIO(text, newline=""), restkey="\0extra", restval=_MISSING)
    if reader.fieldnames is None:
        return [], [], []
    header = list(reader.fieldnames)
    if len(set(header)) != len(header):
        dup = sorted({h for h in header if header.count(h) > 1})
        raise ValueError(f"{path}: duplicate CSV column(s) {', '.join(dup)}; rename them")
    records, rows, rejected = [], [], []
    for number, rec in enumerate(reader, start=1):
        extra = rec.pop("\0extra", None)
        missing = [k for k, v in rec.items() if v is _MISSING]
        raw = snippet(",".join(str(v) for v in rec.values() if v is not _MISSING))
        if extra is not None or missing:
            got = len(header) + (len(extra) if extra else 0) - len(missing)
            rejected.append(
                Rejected(
                    "ingest",
                    path,
                    number,
                    "",
                    f"CSV record has {got} fields, the header has {len(header)} "
                    f"(line {reader.line_num})",
                    raw,
                )
            )
            continue
        bad = [k for k, v in rec.items() if _has_surrogates(v)]
        if bad:
            rejected.append(
                Rejected(
                    "ingest",
                    path,
                    number,
                    ",".join(bad),
                    f"not valid UTF-8 in field(s) {', '.join(bad)} (line {reader.line_num})",
                    snippet(raw.encode("utf-8", "surrogateescape").decode("utf-8", "replace")),
                )
            )
            continue
        records.append({k: (v if v != "" else None) for k, v in rec.items()})
        rows.append(number)
    return records, rows, rejected


def _parquet_frame(path: str, data: bytes) -> pd.DataFrame:
    import pyarrow as pa  # lazy: see the TYPE_CHECKING import
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValueError(f"{path}: not a readable Parquet file ({exc})") from exc
    frame = table.to_pandas(types_mapper=None)
    for name in frame.columns:  # validation works on plain Python values
        if frame[name].dtype != object:
            frame[name] = frame[name].astype(object).where(frame[name].notna(), None)
    return frame


def _object_frame(records: list[dict]) -> pd.DataFrame:
    """Records as object columns, values as parsed: no dtype inference, which would turn the
    integers of a column with a missing value into floats (42 -> 42.0)."""
    import pandas as pd  # lazy: see the TYPE_CHECKING import

    if not records:
        return pd.DataFrame()
    names = dict.fromkeys(k for r in records for k in r)
    frame = pd.DataFrame({k: pd.Series([r.get(k) for r in records], dtype=object) for k in names})
    return frame.where(frame.notna(), None)


def read_file(path: str) -> RawTable:
    """One input file as a raw table plus the records that could not be read."""
    fmt = file_format(path)
    data = read_bytes(path)
    if fmt == "parquet":
        frame = _parquet_frame(path, data)
        rows: list[int] | range = range(1, len(frame) + 1)
        rejected: list[Rejected] = []
    else:
        parse = _jsonl_records if fmt == "jsonl" else _csv_records
        records, rows, rejected = parse(path, data)
        frame = _object_frame(records)
    frame = frame.reset_index(drop=True)
    frame["_file"] = path
    frame["_row"] = list(rows)
    logger.info("%s: %d rows read, %d unreadable", path, len(frame), len(rejected))
    return RawTable(frame, rejected, {path: [c for c in frame.columns if not c.startswith("_")]})


def read_inputs(paths: list[str]) -> RawTable:
    """All rows of several files (columns are the union; absent ones are missing values)."""
    import pandas as pd  # lazy: see the TYPE_CHECKING import

    tables = [read_file(p) for p in paths]
    frames = [t.frame for t in tables if len(t.frame)]
    if frames:
        frame = pd.concat(frames, ignore_index=True, sort=False)
    else:
        frame = pd.DataFrame({"_file": pd.Series([], dtype=object), "_row": []})
    columns = {p: c for t in tables for p, c in t.columns.items()}
    return RawTable(frame, [r for t in tables for r in t.rejected], columns)
