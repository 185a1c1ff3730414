"""The prompt source (docs/design.md §11): a dataset file's rows as (prompt, reference) pairs, for
the preflight, evaluation and the controller alike; each fault a DatasetError naming the file, the
row and what to do, local or gs://."""

from __future__ import annotations

import dataclasses
import json

import pytest

from rlax_tasks.data.prompt_source import (
    DatasetError,
    FilePrompts,
    episode_row,
    open_dataset,
    rejected_note,
)

SUITE = {"cases": [{"input": "1 2", "output": "3"}], "time_limit_s": 2.0}


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a run configuration's FileSource gives the prompt source."""

    path: str
    verifier: str = "math"
    format: str = "rlax"
    columns: dict | None = None


def _jsonl(path, lines: list) -> str:
    """One line per entry: a row as JSON, or a string written as it is (a damaged record)."""
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_rows_become_prompts_with_their_references_in_file_order(tmp_path):
    rows = [{"prompt": "1+1=", "answer": 2}, {"prompt": "2+2=", "answer": "4"}]
    math = _jsonl(tmp_path / "m.jsonl", rows)
    prompts = FilePrompts(Spec(math))
    assert [prompts.get(i) for i in range(len(prompts))] == [("1+1=", "2"), ("2+2=", "4")]
    code = _jsonl(tmp_path / "c.jsonl", [{"prompt": "add", "tests": SUITE}])
    text, reference = FilePrompts(Spec(code, "code")).get(0)
    suite = json.loads(reference)  # the test suite as JSON, what the code verifier reads
    assert text == "add" and [(c["input"], c["output"]) for c in suite["cases"]] == [("1 2", "3")]
    assert suite["time_limit_s"] == 2.0


def test_a_row_without_the_verifier_s_reference_is_named_by_file_and_row(tmp_path):
    rows = [{"prompt": "add", "tests": SUITE}, {"prompt": "sub", "answer": "1"}]
    path = _jsonl(tmp_path / "c.jsonl", rows)
    with pytest.raises(DatasetError) as info:
        FilePrompts(Spec(path, "code"))
    assert (info.value.file, info.value.row) == (path, 2)
    assert "1 row(s) have no tests for verifier 'code'" in str(info.value)
    assert "set the dataset's verifier to match" in str(info.value)


def test_a_damaged_record_is_refused_by_check_intact_and_a_misfit_row_only_left_out(tmp_path):
    rows = [{"prompt": "1+1=", "answer": "2"}, '{"prompt": "7+1=", "answer": ', {"prompt": "x"}]
    path = _jsonl(tmp_path / "d.jsonl", rows)
    prompts = FilePrompts(Spec(path))
    assert len(prompts) == 1  # the damaged line 2 and the unanswered line 3 are left out
    assert sorted((r.stage, r.row) for r in prompts.rejected) == [("ingest", 2), ("validate", 3)]
    with pytest.raises(DatasetError, match=r"row 2 cannot be read: broken JSON") as info:
        prompts.check_intact()
    assert (info.value.file, info.value.row) == (path, 2)
    assert "`rlax data preview` lists them" in str(info.value)
    FilePrompts(Spec(_jsonl(tmp_path / "u.jsonl", [rows[0], rows[2]]))).check_intact()
    note = rejected_note(open_dataset(path))
    assert note == (
        f"2 dataset row(s) could not be read as rlax and were left out; first: {path} row 2: "
        f"{prompts.rejected[0].reason}"
    )
    assert rejected_note(open_dataset(_jsonl(tmp_path / "g.jsonl", [rows[0]]))) is None


def test_missing_or_unusable_files_are_dataset_errors_naming_the_file(tmp_path):
    missing = str(tmp_path / "nowhere.jsonl")
    with pytest.raises(DatasetError, match="no such file.*: fix the path") as info:
        FilePrompts(Spec(missing))
    assert info.value.file == missing
    empty = _jsonl(tmp_path / "e.jsonl", [{"prompt": "1+1="}])
    with pytest.raises(DatasetError, match=rf"{empty} row 1: no answer and no tests") as info:
        open_dataset(empty)
    assert info.value.file == empty


def test_an_episode_row_carries_the_verifier_s_reference():
    assert episode_row("p", "4", "math") == {"prompt": "p", "answer": "4"}
    assert episode_row("p", "4", "task") == {"prompt": "p", "answer": "4"}
    assert episode_row("p", "{}", "code") == {"prompt": "p", "tests": "{}"}


@pytest.mark.timeout(120)
def test_a_gs_dataset_reads_as_a_local_one(tmp_path):
    from rlax_tasks.rundir import storage
    from tests.paramserver.helpers import gcs_emulator

    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4"}]
    local = _jsonl(tmp_path / "m.jsonl", rows)
    with gcs_emulator("rlax-prompts") as bucket:
        remote = f"{bucket}/data/m.jsonl"
        storage.write_bytes(remote, open(local, "rb").read())
        got = FilePrompts(Spec(remote))
        assert (got.prompts, got.references) == (["1+1=", "2+2="], ["2", "4"])
        with pytest.raises(DatasetError) as info:
            FilePrompts(Spec(f"{bucket}/data/absent.jsonl"))
        assert info.value.file == f"{bucket}/data/absent.jsonl"
