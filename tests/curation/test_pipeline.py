"""Time split, decontamination, the pass-rate filter and the `rlax curate` command."""

import dataclasses
import json

import pyarrow.parquet as pq
import pytest

from rlax_tasks.cli import main
from rlax_tasks.curation import CurationConfig, run_curation, write_outputs
from tests.evaluation.helpers import arithmetic_rows, tiny_policy, write_jsonl


def test_time_split_and_decontamination(tmp_path):
    rows = arithmetic_rows(12)
    long_prompt = (
        "A farmer has some chickens and some cows in a field and counts the legs of all the "
        "animals together. How many cows are there if there are 30 heads and 100 legs?"
    )
    rows.append({"prompt": long_prompt, "answer": "20", "source": "words", "date": "2023-01-01"})
    path = write_jsonl(tmp_path / "train.jsonl", rows)
    eval_path = write_jsonl(
        tmp_path / "bench.jsonl",
        [{"prompt": "Problem 7: " + long_prompt.upper()}, {"prompt": rows[0]["prompt"]}],
    )
    config = CurationConfig(inputs=(path,), eval_sets=(eval_path,), split_date="2024-04-01")
    result = run_curation(config)
    assert all(d < "2024-04-01" for d in result.train["date"])
    assert all(d >= "2024-04-01" for d in result.test["date"])
    decon = {r.row: r for r in result.removed if r.stage == "decontaminate"}
    assert sorted(decon) == [1, 13]  # rows[0] (same short prompt) and the long word problem
    assert "eval set" in decon[13].reason and "bench.jsonl" in decon[13].reason
    assert len(result.train) + len(result.test) + 2 == 13


def test_test_split_prompts_decontaminate_train(tmp_path):
    story = (
        "A train leaves the station at noon and travels at a constant speed of sixty miles "
        "per hour toward a city that is {} miles away. When does it arrive?"
    )
    rows = arithmetic_rows(4) + [
        {"prompt": story.format(120), "answer": "2", "source": "w", "date": "2024-02-01"},
        {
            "prompt": "Hint: think. " + story.format(180),
            "answer": "3",
            "source": "w",
            "date": "2025-06-01",
        },
    ]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    config = CurationConfig(inputs=(path,), split_date="2025-01-01")
    result = run_curation(config)
    assert [(r.stage, r.row) for r in result.removed] == [("decontaminate", 5)]
    assert "'test split'" in result.removed[0].reason
    assert len(result.test) == 1 and len(result.train) == 4
    off = run_curation(dataclasses.replace(config, decontaminate_against_test=False))
    assert off.removed == [] and len(off.train) == 5


def scripted_generator(correct_by_prompt):
    """A GenerateFn whose first c completions (c from the prompt) are right, the rest wrong."""

    def generate(prompts, n):
        out = []
        for p in prompts:
            answer, c = correct_by_prompt[p]
            out.append([f"\\boxed{{{answer}}}" if j < c else "\\boxed{-1}" for j in range(n)])
        return out

    return generate


def test_pass_rate_filter_keeps_partial_rates_and_records_them(tmp_path):
    rows = arithmetic_rows(6)
    plan = {r["prompt"]: (r["answer"], c) for r, c in zip(rows, [0, 1, 2, 3, 4, 2], strict=True)}
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    config = CurationConfig(inputs=(path,), pass_rate_k=4, pass_rate_batch=4)
    result = run_curation(config, scripted_generator(plan))
    kept = dict(zip(result.train["prompt"], result.train["pass_rate"], strict=True))
    assert sorted(kept.values()) == [0.25, 0.5, 0.5, 0.75]
    reasons = {r.row: r.reason for r in result.removed if r.stage == "pass_rate"}
    assert reasons[1].startswith("pass rate 0/4") and reasons[5].startswith("pass rate 4/4")
    report = write_outputs(result, config, str(tmp_path / "out"))
    assert report["train_pass_rate_mean"] == pytest.approx(0.5)
    table = pq.read_table(tmp_path / "out" / "train.parquet")
    assert sorted(table.column("pass_rate").to_pylist()) == [0.25, 0.5, 0.5, 0.75]
    assert (tmp_path / "out" / "difficulty.png").exists()


def test_pass_rate_needs_a_generator(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", arithmetic_rows(2))
    with pytest.raises(ValueError, match="model"):
        run_curation(CurationConfig(inputs=(path,), pass_rate_k=4))


@pytest.mark.slow
def test_pass_rate_filter_with_the_real_sampler(tmp_path):
    from rlax_tasks.evaluation import PolicyGenerator

    rows = arithmetic_rows(6) + [
        {
            "prompt": "Compute 1 + 1 with the ♥ glyph.",
            "answer": "2",
            "source": "x",
            "date": "2024-01-01",
        }
    ]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    generator = PolicyGenerator(
        tiny_policy(), max_new_tokens=8, temperature=1.0, seed=0, max_slots=8, max_len=128
    )
    config = CurationConfig(inputs=(path,), pass_rate_k=3, pass_rate_batch=4)  # 2 batches
    result = run_curation(config, generator, generator.unusable)
    stages = [r.stage for r in result.removed]
    assert stages.count("pass_rate") + len(result.train) == 7
    unusable = [r for r in result.removed if "cannot sample" in r.reason]
    assert [r.row for r in unusable] == [7] and "tokenizer" in unusable[0].reason
    measured = [r for r in result.removed if r.reason.startswith("pass rate")]
    # every usable prompt was sampled 3 times: dropped at 0/3 or 3/3, or kept with its rate (a
    # random tiny model mostly fails, but its independent samples may guess a short answer)
    assert len(measured) + len(result.train) == 6 and len(measured) >= 3
    assert all(r.reason.startswith(("pass rate 0/3", "pass rate 3/3")) for r in measured)
    assert all(rate in (1 / 3, 2 / 3) for rate in result.train["pass_rate"])


def test_curate_cli(tmp_path, capsys):
    rows = arithmetic_rows(5)
    path = write_jsonl(tmp_path / "in.jsonl", rows + [rows[0]])
    with open(path, "ab") as fh:
        fh.write(b'{"broken\n')
    out = tmp_path / "out"
    code = main(["curate", path, "--out", str(out), "--split-date", "2024-03-01"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "read 7 rows" in printed and "1 quarantined, 1 removed" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["totals"]["train"] + report["totals"]["test"] == 5
    code = main(["curate", path, "--out", str(out), "--split-date", "03/01/2024"])
    err = capsys.readouterr().err
    assert code == 2 and "split_date" in err and "Traceback" not in err
