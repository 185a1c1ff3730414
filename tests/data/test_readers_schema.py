"""Messy inputs: every bad row lands in the quarantine with its file, row, field and reason."""

import datetime as dt
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlax_tasks.curation import CurationConfig, run_curation, write_outputs
from rlax_tasks.data.readers import read_file, read_inputs
from rlax_tasks.data.schema import validate

# a legacy list of {input, output} tests, as the canonical suite it reads as
SUITE = {
    "cases": [{"input": "1 2", "output": "3", "public": True}],
    "fn_name": None,
    "time_limit_s": None,
    "memory_mb": None,
}


def good(i, **over):
    row = {
        "prompt": f"Compute {i} + {i + 1}. Give the final answer.",
        "answer": str(2 * i + 1),
        "source": "synthetic",
        "date": "2024-03-0" + str(1 + i % 9),
    }
    row.update(over)
    return row


def write_jsonl(path, lines):
    with open(path, "wb") as fh:
        for line in lines:
            fh.write(line if isinstance(line, bytes) else json.dumps(line).encode())
            fh.write(b"\n")
    return str(path)


def by_row(rejected):
    return {r.row: r for r in rejected}


def test_jsonl_unreadable_lines_are_quarantined_with_line_numbers(tmp_path):
    path = write_jsonl(
        tmp_path / "a.jsonl",
        [
            good(1),
            b'{"prompt": "broken", "answer": ',
            b'{"prompt": "caf\xe9 au lait", "answer": "1", "source": "s", "date": "2024-01-01"}',
            b"[1, 2, 3]",
            b"",  # blank line: not a record
            good(2),
        ],
    )
    raw = read_file(path)
    assert len(raw.frame) == 2 and raw.frame["_row"].tolist() == [1, 6]
    rej = by_row(raw.rejected)
    assert sorted(rej) == [2, 3, 4]
    assert rej[2].reason.startswith("broken JSON") and rej[2].stage == "ingest"
    assert "not valid UTF-8" in rej[3].reason and "0xe9" in rej[3].reason
    assert "expected a JSON object" in rej[4].reason and "list" in rej[4].reason
    assert all(r.file == path for r in raw.rejected)
    assert raw.rows_read == 5


def test_wrong_types_name_every_bad_field(tmp_path):
    path = write_jsonl(
        tmp_path / "types.jsonl",
        [
            good(0),
            good(1, prompt=123),
            good(2, answer=["4"], date="yesterday"),
            good(3, answer=None, tests=[{"input": "1"}]),
            good(4, answer=None, tests="[not json"),
            good(5, metadata="just text"),
            good(6, source=""),
            good(7, answer=True),
            good(8, prompt="bad \udc80 surrogate"),
            good(9, answer=7, metadata={"level": 2}, extra_col="kept"),
        ],
    )
    frame, rejected = validate(read_inputs([path]))
    rej = by_row(rejected)
    assert sorted(rej) == [2, 3, 4, 5, 6, 7, 8, 9]
    assert rej[2].field == "prompt" and "expected a string, got int" in rej[2].reason
    assert rej[3].field == "answer,date"
    assert "expected a string or number, got list" in rej[3].reason
    assert "not an ISO date" in rej[3].reason and "'yesterday'" in rej[3].reason
    assert rej[4].field == "tests" and "cases[0] has no output" in rej[4].reason
    assert rej[5].field == "tests" and "not valid JSON" in rej[5].reason
    assert rej[6].field == "metadata" and "not valid JSON" in rej[6].reason
    assert rej[7].field == "source" and "empty" in rej[7].reason
    assert rej[8].field == "answer" and "bool" in rej[8].reason
    assert rej[9].field == "prompt" and "lone surrogate" in rej[9].reason
    assert all(r.stage == "validate" for r in rejected)
    # valid rows: an int answer becomes a string, unknown columns go into metadata
    assert len(frame) == 2
    last = frame.iloc[1]
    assert last["answer"] == "7" and last["metadata"] == {"level": 2, "extra_col": "kept"}


def test_missing_column_is_reported_per_row_and_per_file(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [good(1), good(2)])
    b = write_jsonl(tmp_path / "b.jsonl", [{k: v for k, v in good(3).items() if k != "prompt"}])
    frame, rejected = validate(read_inputs([a, b]))
    assert len(frame) == 2
    assert len(rejected) == 1
    (r,) = rejected
    assert r.file == b and r.row == 1 and r.field == "prompt"
    assert f"{b} has no 'prompt' column" in r.reason


def test_source_and_date_are_optional(tmp_path):
    bare = {k: v for k, v in good(1).items() if k not in ("source", "date")}
    frame, rejected = validate(read_inputs([write_jsonl(tmp_path / "a.jsonl", [bare])]))
    assert rejected == []
    assert frame["source"].tolist() == [None] and frame["date"].tolist() == [None]


def test_csv_field_counts_encoding_and_json_cells(tmp_path):
    path = tmp_path / "c.csv"
    path.write_bytes(
        b"prompt,answer,tests,source,date,metadata\n"
        b'Sum two numbers,,"[{""input"": ""1 2"", ""output"": ""3""}]",code,2024-05-01,'
        b'"{""a"": 1}"\n'
        b"too,few,fields\n"
        b"Na\xefve bytes,1,,s,2024-05-01,\n"
        b"What is 2+2?,4,,math,2024-05-02T10:00:00,\n"
        b"What is 3+3?,6,,math,05/02/2024,\n"
    )
    raw = read_file(str(path))
    rej = by_row(raw.rejected)
    assert "CSV record has 3 fields, the header has 6" in rej[2].reason
    assert "not valid UTF-8" in rej[3].reason and rej[3].field == "prompt"
    frame, invalid = validate(raw)
    assert [r.row for r in invalid] == [5] and "not an ISO date" in invalid[0].reason
    assert frame["tests"].iloc[0] == SUITE
    assert frame["metadata"].iloc[0] == {"a": 1}
    assert frame["answer"].iloc[0] is None
    assert frame["date"].tolist() == ["2024-05-01", "2024-05-02"]


def test_parquet_typed_columns_and_bad_bytes(tmp_path):
    tests_type = pa.list_(pa.struct([("input", pa.string()), ("output", pa.string())]))
    table = pa.table(
        {
            "prompt": pa.array([b"Add the numbers", b"bad \xff bytes", None], pa.binary()),
            "answer": pa.array([None, "1", "2"]),
            "tests": pa.array([[{"input": "1 2", "output": "3"}], None, None], tests_type),
            "source": ["p", "p", "p"],
            "date": pa.array([dt.date(2024, 1, 1)] * 3, pa.date32()),
        }
    )
    path = tmp_path / "p.parquet"
    pq.write_table(table, path)
    frame, rejected = validate(read_inputs([str(path)]))
    rej = by_row(rejected)
    assert sorted(rej) == [2, 3]
    assert "not valid UTF-8" in rej[2].reason and rej[2].field == "prompt"
    assert rej[3].reason == "prompt: missing"
    assert frame["tests"].iloc[0] == SUITE
    assert frame["date"].iloc[0] == "2024-01-01"


def test_every_row_is_accounted_for_end_to_end(tmp_path):
    rows = [
        good(1),
        good(1, prompt="  COMPUTE 1 +   2.  give the final answer. "),  # case/space duplicate
        good(1, prompt="compute 1 + 2. Give the final answer.", answer="4"),  # conflicting
        good(2),
        good(3, answer=None),  # nothing to verify against
        b"{oops",
        good(4, prompt=["not", "a", "string"]),
        good(5, date="2030-01-01"),
    ]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    config = CurationConfig(inputs=(path,), split_date="2025-01-01")
    result = run_curation(config)
    counts = result.counts()
    assert counts == {"rows_read": 8, "train": 2, "test": 1, "quarantined": 2, "removed": 3}
    removed = {r.row: r for r in result.removed}
    assert removed[2].stage == removed[3].stage == "exact_dedup"
    assert f"exact duplicate of {path}:1" in removed[2].reason
    assert "answers differ" in removed[3].reason and "answers differ" not in removed[2].reason
    assert removed[5].stage == "missing_reference"

    out = tmp_path / "out"
    report = write_outputs(result, config, str(out))
    assert report["totals"] == counts
    quarantine = [json.loads(x) for x in (out / "quarantine.jsonl").read_text().splitlines()]
    assert [(q["row"], q["stage"]) for q in quarantine] == [(6, "ingest"), (7, "validate")]
    assert len((out / "removed.jsonl").read_text().splitlines()) == 3
    train = pq.read_table(out / "train.parquet")
    assert train.num_rows == 2 and train.schema.field("date").type == pa.date32()
    assert pq.read_table(out / "test.parquet").column("origin_row").to_pylist() == [8]
    assert (out / "lengths.png").read_bytes()[:4] == b"\x89PNG"
    md = (out / "report.md").read_text()
    assert "| exact_dedup | 5 | 2 | 3 |" in md
    stages = {s["stage"]: s for s in report["stages"]}
    assert stages["ingest"]["removed"] == 1 and stages["validate"]["removed"] == 1


def test_bad_config_and_paths_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="split_date"):
        CurationConfig(inputs=("x.jsonl",), split_date="2024-02-30")
    with pytest.raises(ValueError, match="inputs"):
        CurationConfig(inputs=())
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        run_curation(CurationConfig(inputs=(str(tmp_path / "nope.jsonl"),)))
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="unknown input format"):
        run_curation(CurationConfig(inputs=(str(tmp_path / "x.txt"),)))
