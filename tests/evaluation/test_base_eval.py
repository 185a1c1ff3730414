"""The base model's held-out evaluation (eval/v0), cached per model, data and evaluation settings
under <run_root>/base-evals/ (rlax_tasks.evaluation.base_eval and the rlax_train DAG's tasks)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from rlax_tasks.airflow import eval_planning as rc
from rlax_tasks.config import DatasetSpec, FileSource, load_config, save_resolved
from rlax_tasks.evaluation.base_eval import evaluate_base
from rlax_tasks.rundir.paths import run_paths


class FakeEval:
    """`rlax eval` stand-in: writes results.json and summary.md where --out says; counts calls."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> None:
        self.calls.append(argv)
        out = argv[argv.index("--out") + 1]
        os.makedirs(out, exist_ok=True)
        overall = {"prompts": 4, "pass@1": 0.25 * len(self.calls), "pass@2": 0.5, "skipped": 0}
        with open(os.path.join(out, "summary.md"), "w") as f:
            f.write("# Evaluation\n")
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump({"dataset": argv[argv.index("--dataset") + 1],
                       "models": [{"name": "base", "overall": overall}]}, f)  # fmt: skip


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "models" / "base"
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "qwen2"}')
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return str(path)


def config(tmp_path, model_dir: str, run_id: str, dataset: str | None = None, **overrides):
    """The tiny-arith run ``run_id`` on ``model_dir``, held out on its synthetic task or on the
    file ``dataset``."""
    cfg = load_config(
        "tiny-arith",
        {
            "run_root": str(tmp_path / "runs"),
            "run_id": run_id,
            "model.path": model_dir,
            "model.warmup_if_missing": False,
            "eval.num_prompts": 4,
            "eval.num_samples": 2,
            "eval.ks": [1, 2],
            **overrides,
        },
    )
    if dataset is None:
        return cfg
    spec = DatasetSpec("held", FileSource(dataset))
    return dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, dataset=spec))


def base_eval(cfg, fake: FakeEval) -> bool:
    save_resolved(cfg)
    return evaluate_base(cfg, rc.base_eval_argv(cfg, rc.eval_dataset_file(cfg)), fake)


def results(cfg) -> dict:
    with open(run_paths(cfg.run_dir).eval_results(0)) as f:
        return json.load(f)


def test_a_second_run_with_the_same_model_data_and_settings_is_not_evaluated_again(
    tmp_path, model_dir
):
    fake = FakeEval()
    first = config(tmp_path, model_dir, "first")
    assert base_eval(first, fake) is True and len(fake.calls) == 1
    (argv,) = fake.calls
    assert "--weights-from" not in argv  # the model directory alone: the starting weights
    assert argv[argv.index("--out") + 1] == run_paths(first.run_dir).eval_dir(0)
    cached = os.listdir(os.path.join(tmp_path, "runs", "base-evals"))
    assert len(cached) == 1
    entry = os.path.join(tmp_path, "runs", "base-evals", cached[0])
    assert {"results.json", "summary.md", "inputs.json"} <= set(os.listdir(entry))

    # another run, and the first run resumed: copied, not evaluated
    second = config(tmp_path, model_dir, "second")
    assert base_eval(second, fake) is False and len(fake.calls) == 1
    assert results(second) == results(first)
    assert os.path.exists(os.path.join(run_paths(second.run_dir).eval_dir(0), "summary.md"))
    assert base_eval(first, fake) is False and len(fake.calls) == 1
    # what else a run changes (its steps, its staleness) is not the evaluation's business
    other = config(
        tmp_path, model_dir, "third", **{"staleness.reload_every": 2, "staleness.max_staleness": 4}
    )
    assert base_eval(other, fake) is False and len(fake.calls) == 1


@pytest.mark.parametrize(
    "override",
    [
        {"eval.temperature": 0.5},
        {"eval.num_samples": 4},
        {"eval.num_prompts": 8},
        {"rollout.max_new_tokens": 12},
        {"prompt.template": "raw", "prompt.instruction": "Answer:"},
        {"eval.dataset.source.seed": 2},
    ],
    ids=lambda o: next(iter(o)),
)
def test_a_changed_evaluation_setting_evaluates_again(tmp_path, model_dir, override):
    fake = FakeEval()
    assert base_eval(config(tmp_path, model_dir, "first"), fake) is True
    assert base_eval(config(tmp_path, model_dir, "changed", **override), fake) is True
    assert len(fake.calls) == 2
    assert len(os.listdir(os.path.join(tmp_path, "runs", "base-evals"))) == 2


def test_changed_weights_or_dataset_file_evaluate_again(tmp_path, model_dir):
    fake = FakeEval()
    data = tmp_path / "heldout.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert base_eval(config(tmp_path, model_dir, "a", str(data)), fake) is True
    assert base_eval(config(tmp_path, model_dir, "b", str(data)), fake) is False
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    assert base_eval(config(tmp_path, model_dir, "c", str(data)), fake) is True
    with open(os.path.join(model_dir, "model.safetensors"), "ab") as f:
        f.write(b"\1")  # fine-tuned further: other weights
    assert base_eval(config(tmp_path, model_dir, "d", str(data)), fake) is True
    assert len(fake.calls) == 3


def test_the_dag_tasks_skip_the_job_on_a_cache_hit(tmp_path, model_dir):
    """rlax_train's base_eval → evaluate_base (a job; skipped on an empty argv) →
    record_base_eval, as rc.prepare_base_eval / rc.record_base_eval do them."""
    fake = FakeEval()
    first = config(tmp_path, model_dir, "first")
    save_resolved(first)
    plan = rc.prepare_base_eval(first.run_dir)
    assert plan["argv"] and plan["argv"][0] == "eval"
    fake(plan["argv"])  # the evaluate_base job
    rc.record_base_eval(plan)

    second = config(tmp_path, model_dir, "second")
    save_resolved(second)
    again = rc.prepare_base_eval(second.run_dir)
    assert again["argv"] == [] and again["fingerprint"] == plan["fingerprint"]
    assert results(second) == results(first)
    rc.record_base_eval(again)  # nothing to record: no error, one entry
    assert len(os.listdir(os.path.join(tmp_path, "runs", "base-evals"))) == 1


def test_a_job_that_wrote_no_results_is_not_cached(tmp_path, model_dir):
    cfg = config(tmp_path, model_dir, "first")
    save_resolved(cfg)
    plan = rc.prepare_base_eval(cfg.run_dir)
    with pytest.raises(FileNotFoundError, match="results.json does not exist"):
        rc.record_base_eval(plan)
    assert rc.prepare_base_eval(cfg.run_dir)["argv"]  # still to evaluate


def test_a_tool_run_is_evaluated_as_episodes_of_its_environment(tmp_path):
    """The DAG's evaluations of a run whose held-out dataset names an environment (tiny-calc)
    run `rlax eval --environment-from` the run's config, and its base evaluation is cached
    apart from a single-turn one of the same data."""
    model = str(tmp_path / "models" / "tiny-calc")
    overrides = {"run_root": str(tmp_path / "runs"), "model.path": model,
                 "model.warmup_if_missing": False}  # fmt: skip
    tools = load_config("tiny-calc", {**overrides, "run_id": "tools"})
    argv = rc.eval_argv(tools, 3, rc.eval_dataset_file(tools))
    i = argv.index("--environment-from")
    assert argv[i + 1] == run_paths(tools.run_dir).config
    single = load_config("tiny-calc", {**overrides, "run_id": "single",
                                       "eval.dataset.environment": None})  # fmt: skip
    assert "--environment-from" not in rc.eval_argv(single, 3, rc.eval_dataset_file(single))
    from rlax_tasks.evaluation.base_eval import fingerprint_inputs

    os.makedirs(model)
    with open(os.path.join(model, "config.json"), "w") as f:
        f.write('{"model_type": "qwen2"}')
    base = rc.base_eval_argv(tools, "d.jsonl")
    j = base.index("--environment-from")
    with_env = fingerprint_inputs(tools, base)
    without = fingerprint_inputs(tools, base[:j] + base[j + 2 :])
    assert with_env["episodes"] is True and without["episodes"] is False
