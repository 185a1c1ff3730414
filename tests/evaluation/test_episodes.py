"""Multi-turn held-out evaluation (`rlax eval --environment-from`, docs/design.md §15): each row
an episode of the environment on the real sampler, scored by the environment, not by the math
verifier reading the text; rows whose episode cannot start are skipped with the reason."""

from __future__ import annotations

import os

import pytest
import yaml

from rlax_tasks.config import RunConfig
from rlax_tasks.data.dataset import load_dataset
from rlax_tasks.environments import EnvironmentSpec
from rlax_tasks.evaluation.episodes import EpisodeGenerator, episode_rows
from rlax_tasks.evaluation.evaluator import EvalConfig, evaluate
from rlax_tasks.rollout import Sampler, per_prompt_params
from rlax_tasks.rollout.episodes import run_episodes
from tests.evaluation.helpers import write_jsonl
from tests.rollout.episode_helpers import CALLS_ENV, turn_ending_policy

PRESETS = os.path.join(os.path.dirname(__file__), "..", "..", "rlax_tasks", "presets")
SPEC = EnvironmentSpec("counted-echo", max_turns=2, tool_timeout_s=2.0, max_observation_tokens=32)


@pytest.fixture(autouse=True)
def calls_file(tmp_path, monkeypatch):
    monkeypatch.setenv(CALLS_ENV, str(tmp_path / "calls.jsonl"))


def test_rows_are_episodes_scored_by_their_environment(tmp_path):
    rows = [{"prompt": f"{i}+{i}=?", "answer": str(2 * i)} for i in range(3)]
    rows.append({"prompt": "9" * 400, "answer": "1"})  # its episode cannot fit max_len
    dataset = load_dataset(write_jsonl(tmp_path / "d.jsonl", rows))
    policy = turn_ending_policy()
    settings = {"max_new_tokens": 24, "temperature": 1.0, "seed": 3, "max_slots": 8,
                "max_len": 256}  # fmt: skip
    generator = EpisodeGenerator(policy, environment=SPEC, **settings)
    result = evaluate(dataset.frame, generator, EvalConfig(n=2, ks=(1, 2)), "tiny")

    assert len(result.skipped) == 1 and len(result.rows) == 3
    assert "more than 232" in result.skipped[0]["reason"]
    # the reference: the same episodes run directly, with the same per-row seeds
    params = per_prompt_params(3, 3, max_new_tokens=24, temperature=1.0, stop_strings=())
    episodes = run_episodes(Sampler(policy, max_slots=8, max_len=256), SPEC,
                            episode_rows(dataset.frame.iloc[:3]), 2, params)  # fmt: skip
    want = [[float(c.reward) for c in comps] for comps in episodes]
    assert [r["rewards"] for r in result.rows] == want
    assert all(x > 0 for row in want for x in row)  # the echo rewards every step; text would not
    decode = policy.tokenizer.decode
    assert [r["completions"] for r in result.rows] == [
        [decode(c.tokens, skip_special_tokens=True) for c in comps] for comps in episodes
    ]
    assert result.overall["pass@1"] == 1.0 and result.overall["maj_prompts"] == 0


def test_the_held_out_job_runs_the_same_episodes(tmp_path):
    """`rlax heldout`'s pass@k of a dataset with an environment: the rows of its file run as
    episodes with training's seeds, the row whose episode cannot start skipped with why."""
    from rlax_tasks.run.report import HeldOutEvaluator

    rows = [{"prompt": f"{i}+{i}=?", "answer": str(2 * i)} for i in range(3)]
    rows.insert(1, {"prompt": "9" * 400, "answer": "1"})  # its episode cannot fit max_len
    model = str(tmp_path / "model")
    turn_ending_policy().save_pretrained(model)
    raw = yaml.safe_load(open(os.path.join(PRESETS, "tiny-arith.yaml")))
    raw["run_root"], raw["run_id"], raw["model"]["path"] = str(tmp_path / "runs"), "r", model
    raw["rollout"]["max_new_tokens"] = 24
    raw["workers"].update(slots=8, max_len=256)
    raw["eval"].update(num_samples=2, ks=[1, 2])
    raw["eval"]["dataset"] = {
        "name": "held", "source": {"path": write_jsonl(tmp_path / "held.jsonl", rows)},
        "environment": {"name": "counted-echo", "max_turns": 2, "tool_timeout_s": 2.0,
                        "max_observation_tokens": 32},
    }  # fmt: skip
    cfg = RunConfig.from_dict(raw)
    evaluator = HeldOutEvaluator(cfg)
    result = evaluator.evaluate()

    assert evaluator.skipped == [
        {"prompt_id": "held/0/1", "reason": evaluator.skipped[0]["reason"]}
    ]
    assert "more than 232" in evaluator.skipped[0]["reason"]
    # the reference: the rows as written, run directly with seed 0's per-row seeds
    usable = [rows[0], rows[2], rows[3]]
    params = per_prompt_params(0, 3, max_new_tokens=24, temperature=cfg.eval.temperature,
                               stop_strings=tuple(cfg.prompt.stop))  # fmt: skip
    episodes = run_episodes(Sampler(evaluator.policy, max_slots=8, max_len=256),
                            cfg.eval.dataset.environment, usable, 2, params)  # fmt: skip
    want = [[float(c.reward or 0.0) for c in comps] for comps in episodes]
    assert result["mean_reward"] == pytest.approx(sum(map(sum, want)) / 6)
    correct = [sum(x > 0 for x in row) for row in want]
    assert result["pass@1"] == pytest.approx(sum(correct) / 6)
    assert result["num_prompts"] == 3 and result["skipped"] == 1


def test_a_config_without_an_environment_is_refused_naming_the_field(tmp_path):
    from rlax_tasks.config import load_config, save_resolved
    from rlax_tasks.evaluation.episodes import load_environment

    cfg = load_config("tiny-arith", {"run_root": str(tmp_path), "run_id": "r"})
    path = save_resolved(cfg)
    with pytest.raises(ValueError, match="eval.dataset.environment is not set"):
        load_environment(path)
