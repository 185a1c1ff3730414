"""Evaluating with a real (tiny) model logs samples generated and prompts evaluated / total."""

from __future__ import annotations

import logging
import re

from rlax_tasks.data import load_dataset
from rlax_tasks.evaluation import EvalConfig, PolicyGenerator, evaluate
from rlax_tasks.utils.progress_meter import EVERY_ENV
from tests.evaluation.helpers import arithmetic_rows, tiny_policy, write_jsonl


def test_evaluation_logs_samples_and_prompts_done(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(EVERY_ENV, "0")  # every completion and every batch logs a line
    frame = load_dataset(write_jsonl(tmp_path / "eval.jsonl", arithmetic_rows(3))).frame
    # the shapes of test_evaluator's `rlax eval` test: one compilation serves both
    generator = PolicyGenerator(tiny_policy(), max_new_tokens=4, max_slots=8, max_len=96)
    with caplog.at_level(logging.INFO, logger="rlax_tasks.evaluation"):
        result = evaluate(frame, generator, EvalConfig(n=2, ks=(1,)), "tiny")
    assert len(result.rows) == 3
    text = caplog.text
    # each of the 3 x 2 samples is counted as it finishes
    assert [int(m) for m in re.findall(r"sampling: (\d+)/6 samples \(", text)] == [1, 2, 3, 4, 5, 6]
    assert re.search(r"sampling: 6/6 samples done in \S+ \(\S+/s\)", text)
    assert re.search(r"eval tiny: 3/3 prompts \(100%\) \S+/s eta 0s reward 0", text)
    assert re.search(r"eval tiny: 3/3 prompts done in \S+ \(\S+/s\) reward 0", text)
