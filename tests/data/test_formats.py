"""Format adapters on the public layouts (tests/data/layouts.py), `rlax curate --format` end to
end on each of them, and the edge cases: answer extraction, code limits, user mappings, errors."""

import base64
import csv
import json
import pickle
import re
import time
import zlib

import pyarrow.parquet as pq
import pytest

from rlax_tasks.cli import main
from rlax_tasks.data.answers import gsm8k_answer, last_boxed
from rlax_tasks.data.dataset import read_dataset
from rlax_tasks.data.errors import FieldError
from rlax_tasks.data.formats import convert_record, get_format
from rlax_tasks.data.normalize import normalize_prompt
from tests.data.layouts import WRITERS, write_gsm8k

_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (?:DEBUG|INFO|WARNING) ")


def _accepted(fx):
    """(1-based row, {prompt, answer, tests}) of each row the reader must keep, in file order."""
    keys = ("prompt", "answer", "tests")
    return [(i, {k: r[k] for k in keys}) for i, r in enumerate(fx.rows, 1) if r["bad"] is None]


def _bad(fx):
    return [(i, r["bad"]) for i, r in enumerate(fx.rows, 1) if r["bad"] is not None]


def _refs(prompts, answers, tests):
    rows = zip(prompts, answers, tests, strict=True)
    return [{"prompt": p, "answer": a, "tests": t} for p, a, t in rows]


def _jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def _error_line(capsys):
    """The one line `rlax` printed on stderr besides its log lines."""
    lines = [x for x in capsys.readouterr().err.splitlines() if not _LOG_LINE.match(x)]
    assert len(lines) == 1, lines
    assert lines[0].startswith("rlax curate: error: ")
    return lines[0]


@pytest.fixture(params=WRITERS, ids=lambda w: w.__name__)
def layout(request, tmp_path):
    return request.param(str(tmp_path))


# ------------------------------------------------------------------------ public layouts
def test_format_reads_public_layout(layout):
    rows = read_dataset(layout.path, layout.format)
    frame, expected = rows.frame, _accepted(layout)
    assert frame["origin_row"].tolist() == [i for i, _ in expected]
    # read_dataset keeps the text as read; curation and load_dataset normalize it
    prompts = [normalize_prompt(p) for p in frame["prompt"]]
    assert _refs(prompts, frame["answer"], frame["tests"]) == [e for _, e in expected]
    assert [(r.row, r.field) for r in rows.rejected] == _bad(layout)
    for rejected, (_, column) in zip(rows.rejected, _bad(layout), strict=True):
        assert rejected.stage == "validate" and rejected.reason.startswith(f"{column}: ")
    assert rows.rows_read == len(frame) + len(rows.rejected) == len(layout.rows)


def test_curate_format_end_to_end(layout, tmp_path):
    out = tmp_path / "curated"
    argv = ["curate", layout.path, "--out", str(out), "--format", layout.format, "--no-near-dedup"]
    assert main(argv) == 0
    expected, bad = _accepted(layout), _bad(layout)
    train = pq.read_table(out / "train.parquet").to_pylist()
    # no filter removes a fixture row (statements are English, none repeats): all of them train
    assert pq.read_table(out / "test.parquet").num_rows == 0
    assert _jsonl(out / "removed.jsonl") == []
    assert [r["origin_row"] for r in train] == [i for i, _ in expected]
    for row, (_, want) in zip(train, expected, strict=True):  # chat prompts come back in messages
        chat = isinstance(want["prompt"], list)
        assert (row["prompt"] is None, row["messages"] is not None) == (chat, chat)
    prompts = [r["prompt"] if r["messages"] is None else r["messages"] for r in train]
    refs = _refs(prompts, [r["answer"] for r in train], [r["tests"] for r in train])
    assert refs == [e for _, e in expected]
    quarantine = _jsonl(out / "quarantine.jsonl")
    assert [(q["row"], q["field"], q["stage"]) for q in quarantine] == [
        (i, column, "validate") for i, column in bad
    ]
    totals = json.loads((out / "report.json").read_text())["totals"]
    assert totals == {
        "rows_read": len(layout.rows),
        "train": len(expected),
        "test": 0,
        "quarantined": len(bad),
        "removed": 0,
    }

    back = read_dataset(str(out / "train.parquet"))  # the row schema reads its own output
    assert back.rejected == []
    assert _refs(back.frame["prompt"], back.frame["answer"], back.frame["tests"]) == refs


def test_gsm8k_layout_as_csv(tmp_path):
    fx = write_gsm8k(str(tmp_path))
    path = tmp_path / "gsm8k.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, ["question", "answer"])
        writer.writeheader()
        writer.writerows(_jsonl(fx.path))
    rows = read_dataset(str(path), "gsm8k")
    expected = [e for _, e in _accepted(fx)]
    assert [normalize_prompt(p) for p in rows.frame["prompt"]] == [e["prompt"] for e in expected]
    assert rows.frame["answer"].tolist() == [e["answer"] for e in expected]
    assert [(r.row, r.field) for r in rows.rejected] == _bad(fx)


# ------------------------------------------------------------------------ answers
@pytest.mark.parametrize(
    "solution, expected",
    [
        ("40*25 = <<40*25=1000>>1000 books.\n#### 1,000", "1000"),
        ("It was -5 degrees.\n#### -5", "-5"),
        ("#### 0.75", "0.75"),
        ("It costs $1,200.\n#### $1,200", "1200"),
        ("Tom has 3+2 = 5 apples.\nThe answer is 5.", None),
        ("#### seventy", None),
    ],
)
def test_gsm8k_answer(solution, expected):
    assert gsm8k_answer(solution) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so $\frac{3}{6} = \boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"roots $\boxed{2}$ and $5$; the larger is $\boxed{5}$.", "5"),
        (r"unbalanced $\boxed{\frac{1}{2}$", None),
        (r"the answer is \fbox{7}", "7"),
        ("no box at all", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


def test_last_boxed_is_linear_on_degenerate_output():
    start = time.perf_counter()
    assert last_boxed("\\boxed{" * 6000) is None  # ~8 ms; a quadratic scan takes ~7 s
    assert time.perf_counter() - start < 1.0


# ------------------------------------------------------------------------ user mapping, names
def test_columns_format_with_user_mapping(tmp_path):
    path = _write_jsonl(
        tmp_path / "own.jsonl",
        [
            {"question": "What is 6 times 7?", "final_answer": 42, "topic": "arithmetic"},
            {"question": "What is 2 to the 10th power?", "topic": "powers"},
        ],
    )
    # row 2 lacks final_answer: the integer 42 must not be read as the float 42.0
    rows = read_dataset(path, "columns", {"prompt": "question", "answer": "final_answer"})
    assert rows.frame[["prompt", "answer"]].values.tolist() == [["What is 6 times 7?", "42"]]
    assert rows.frame["metadata"].tolist() == [{"topic": "arithmetic"}]
    [rejected] = rows.rejected
    assert (rejected.row, rejected.field) == (2, "final_answer")
    assert rejected.reason.startswith("final_answer: ")


@pytest.mark.parametrize(
    "name, columns, message",
    [
        ("gsm8", None, r"unknown dataset format 'gsm8' \(did you mean 'gsm8k'\?\); formats: rlax"),
        ("columns", {"answer": "final_answer"}, r"columns: map prompt and answer"),
        ("columns", None, r"format 'columns' needs a mapping"),
        ("gsm8k", {"prompt": "question"}, r"columns: only for format 'columns', not 'gsm8k'"),
    ],
)
def test_get_format_errors(name, columns, message):
    with pytest.raises(ValueError, match=message):
        get_format(name, columns)


# ------------------------------------------------------------------------ code
_SUM = {"question": "Print a + b.", "input_output": '{"inputs": ["1 2\\n"], "outputs": ["3\\n"]}'}


@pytest.mark.parametrize(
    "limits, expected",
    [
        ({"time_limit": "2 seconds"}, (2.0, None)),
        ({"time_limit": "1.5"}, (1.5, None)),
        ({"time_limit": {"seconds": 1, "nanos": 500_000_000}}, (1.5, None)),
        ({"memory_limit": "256 megabytes"}, (None, 256)),
        ({"memory_limit_bytes": 256_000_000}, (None, 256)),  # code_contests' "256 megabytes"
        ({"memory_limit_bytes": 268_435_456}, (None, 269)),
        ({"memory_limit_bytes": 0, "time_limit": None}, (None, None)),  # code_contests: unset
    ],
)
def test_code_limits(limits, expected):
    tests = convert_record(get_format("code"), {**_SUM, **limits})["tests"]
    assert (tests["time_limit_s"], tests["memory_mb"]) == expected


def test_code_limit_that_is_no_limit_names_its_column():
    with pytest.raises(FieldError, match="not a memory limit") as err:
        convert_record(get_format("code"), {**_SUM, "memory_limit": "lots"})
    assert err.value.field == "memory_limit"


class _OpensFile:
    """Unpickling it creates a file: the proof that a pickle was loaded."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_livecodebench_compressed_private_tests_are_never_unpickled(tmp_path):
    canary = tmp_path / "unpickled"
    compressed = base64.b64encode(zlib.compress(pickle.dumps(_OpensFile(str(canary)))))
    public = [{"input": "1 2\n", "output": "3\n", "testtype": "stdin"}]
    record = {
        "question_content": "Print the sum of A and B.",
        "public_test_cases": json.dumps(public),
        "private_test_cases": compressed.decode(),
    }
    rows = read_dataset(_write_jsonl(tmp_path / "lcb.jsonl", [record]), "code")
    [rejected] = rows.rejected
    assert rejected.field == "private_test_cases"
    assert re.search(r"compressed pickle, which is never loaded", rejected.reason)
    assert not canary.exists()


def test_livecodebench_contest_dates_split_by_time(tmp_path):
    """A code set dated by contest_date splits by time: later contests become the test set."""
    cases = json.dumps([{"input": "1\n", "output": "1\n", "testtype": "stdin"}])
    rows = [
        {"question_content": f"Print the number {i} you read.", "public_test_cases": cases,
         "contest_date": f"2024-0{i}-15T00:00:00", "question_id": str(i)}
        for i in (1, 5, 9)
    ]  # fmt: skip
    path = _write_jsonl(tmp_path / "lcb.jsonl", rows)
    assert read_dataset(path, "code").frame["date"].tolist() == [
        "2024-01-15", "2024-05-15", "2024-09-15"
    ]  # fmt: skip
    out = tmp_path / "out"
    argv = ["curate", path, "--out", str(out), "--format", "code", "--split-date", "2024-05-01"]
    assert main(argv) == 0
    test = pq.read_table(out / "test.parquet").to_pylist()
    assert [json.loads(r["metadata"])["question_id"] for r in test] == ["5", "9"]
    bad = [dict(rows[0], contest_date="last spring")]
    [rejected] = read_dataset(_write_jsonl(tmp_path / "bad.jsonl", bad), "code").rejected
    assert rejected.field == "contest_date" and "not an ISO date" in rejected.reason


# ------------------------------------------------------------------------ rlax curate errors
def test_curate_split_date_without_dates_exits_2(tmp_path, capsys):
    fx = write_gsm8k(str(tmp_path))
    out = tmp_path / "out"
    argv = ["curate", fx.path, "--out", str(out), "--format", "gsm8k", "--split-date", "2024-01-01"]
    assert main(argv) == 2
    assert "5 of 5 rows have no date" in _error_line(capsys)
    assert not out.exists()


def test_curate_columns_without_mapping_exits_2(tmp_path, capsys):
    fx = write_gsm8k(str(tmp_path))
    assert main(["curate", fx.path, "--out", str(tmp_path / "out"), "--format", "columns"]) == 2
    assert "format 'columns' needs a mapping of fields to columns" in _error_line(capsys)
