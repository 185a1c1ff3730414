"""Curation logs each stage's progress over the rows, and the pass-rate measurement's."""

from __future__ import annotations

import logging
import re

import pytest

from rlax_tasks.curation import CurationConfig, MinHashConfig, run_curation
from rlax_tasks.utils.progress_meter import EVERY_ENV
from tests.evaluation.helpers import arithmetic_rows, write_jsonl


def test_stages_and_pass_rates_log_rows_done(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(EVERY_ENV, "0")  # every update logs a line
    rows = arithmetic_rows(10)
    path = write_jsonl(tmp_path / "in.jsonl", rows + [rows[0]])  # one exact duplicate
    eval_path = write_jsonl(tmp_path / "bench.jsonl", [{"prompt": rows[1]["prompt"]}])

    def generate(prompts, n):  # never right: every prompt goes at 0/2
        return [["\\boxed{-1}"] * (n - 1) + ["no answer"] for _ in prompts]

    config = CurationConfig(
        inputs=(path,),
        eval_sets=(eval_path,),
        minhash=MinHashConfig(chunk_rows=4),
        pass_rate_k=2,
        pass_rate_batch=3,
    )
    with caplog.at_level(logging.INFO, logger="rlax_tasks.curation"):
        run_curation(config, generate)
    text = caplog.text
    assert re.search(r"normalize: 11/11 rows done in \S+ \(.*/s\) removed 0", text)
    assert "exact_dedup: removed 1 of 11 rows" in text
    # near dedup signs 4 rows a chunk: 4, 8, 10 of 10
    for done in (4, 8):
        assert re.search(rf"near_dedup: {done}/10 rows \(\d+%\) \S+/s eta \S+", text)
    assert re.search(r"near_dedup: 10/10 rows done in .* removed 0", text)
    assert re.search(r"decontaminate: 10/10 rows done in .* removed 1", text)
    # 9 prompts measured 3 at a time, every one rejected at 0/2
    assert [int(m) for m in re.findall(r"pass_rate: (\d+)/9 rows \(", text)] == [3, 6, 9]
    assert re.search(r"pass_rate: 9/9 rows done in .* removed 9", text)


@pytest.mark.parametrize("stage", ["missing_reference", "non_english", "interactive"])
def test_every_row_filter_reports(tmp_path, monkeypatch, caplog, stage):
    monkeypatch.setenv(EVERY_ENV, "0")
    path = write_jsonl(tmp_path / "in.jsonl", arithmetic_rows(3))
    with caplog.at_level(logging.INFO, logger="rlax_tasks.curation"):
        run_curation(CurationConfig(inputs=(path,), near_dedup=False))
    assert re.search(rf"{stage}: 3/3 rows \(100%\) .*\n.*{stage}: 3/3 rows done in", caplog.text)
